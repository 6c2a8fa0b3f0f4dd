# kvroute container image: build with the Rust toolchain, ship only the binary on a distroless base.
#   docker build -t kvroute:dev .
#   docker run --rm -p 8080:8080 -v "$PWD/config/prefix.yaml:/etc/kvroute/kvroute.yaml:ro" kvroute:dev
# The image runs as the distroless `nonroot` user (65532) and answers its own health check with
# `kvroute healthcheck`, since the base image has no shell or curl.

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY benches ./benches
COPY src ./src
RUN cargo build --release --locked --bin kvroute

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/kvroute /usr/local/bin/kvroute
COPY config/prefix.yaml /etc/kvroute/kvroute.yaml
USER 65532:65532
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=4s --start-period=5s --retries=3 \
    CMD ["/usr/local/bin/kvroute", "healthcheck", "--url", "http://127.0.0.1:8080/health"]
ENTRYPOINT ["/usr/local/bin/kvroute"]
CMD ["serve", "--config", "/etc/kvroute/kvroute.yaml"]
