# kvroute container image: build with the Rust toolchain, ship only the binary on a distroless base.
#   docker build -t kvroute:dev .
#   docker run --rm -p 8080:8080 -v "$PWD/config/prefix.yaml:/etc/kvroute/kvroute.yaml:ro" kvroute:dev
# The image runs as the distroless `nonroot` user (65532) and answers its own health check with
# `kvroute healthcheck`, since the base image has no shell or curl.
#
# By default the binary is profile-guided (benches/pgo_build.sh: built instrumented, trained on
# loopback inside the build stage against simulated workers, built again; about 17 minutes on 2
# cores), about a tenth less CPU per request than the plain build (docs/measurements.md, "Proxy
# overhead against nginx"). `--build-arg PGO=0` builds the plain release binary instead (about 5
# minutes).

FROM rust:1.95-slim-bookworm AS build
ARG PGO=1
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY benches ./benches
COPY src ./src
# jemalloc (the binary's allocator) is built from C with `make`; the training's non-streaming
# clients are Python; llvm-profdata comes from rustup (llvm-tools).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends make python3 \
    && rm -rf /var/lib/apt/lists/* \
    && if [ "$PGO" = 1 ]; then \
        benches/pgo_build.sh /src/kvroute; \
    else \
        cargo build --release --locked --bin kvroute && cp target/release/kvroute /src/kvroute; \
    fi

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/kvroute /usr/local/bin/kvroute
COPY config/prefix.yaml /etc/kvroute/kvroute.yaml
USER 65532:65532
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=4s --start-period=5s --retries=3 \
    CMD ["/usr/local/bin/kvroute", "healthcheck", "--url", "http://127.0.0.1:8080/health"]
ENTRYPOINT ["/usr/local/bin/kvroute"]
CMD ["serve", "--config", "/etc/kvroute/kvroute.yaml"]
