//! The proxy stage: pick a worker with a policy, send the request over a pooled hyper client,
//! and relay the response body frame by frame with an in-flight tracker attached to it.
//!
//! The tracker is the request's accounting: it holds the worker's in-flight slot, and when it is
//! dropped it releases the slot exactly once and records how the request ended. Dropped before
//! it was marked finished means the client went away (while waiting for headers, or while the
//! body streamed); dropping it also drops the upstream connection, which is how vLLM learns to
//! abort the generation.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use axum::{body::Body, response::Response};
use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Request, Uri};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::TokioExecutor,
};
use tokio::time::{Instant, Sleep};

use crate::{
    config::Config,
    error::ApiError,
    metrics::Metrics,
    policy::arms::{Arm, ARM_HEADER},
    routing_key::RequestInfo,
    workers::{eligible, InflightGuard, Pool},
};

/// Response header naming the worker that served the request.
pub const WORKER_HEADER: &str = "x-kvroute-worker";

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn http_client(cfg: &Config) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(cfg.timeouts.connect()));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .build(connector)
}

/// Everything the proxy stage needs, shared by all requests.
pub struct Upstreams {
    pub pool: Pool,
    pub client: HttpClient,
    pub metrics: Metrics,
    pub config: Config,
}

/// Which kind of request this is, for the `route` label and for whether routing is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Completions,
    ChatCompletions,
    Passthrough,
}

impl Route {
    pub fn as_str(self) -> &'static str {
        match self {
            Route::Completions => "completions",
            Route::ChatCompletions => "chat_completions",
            Route::Passthrough => "passthrough",
        }
    }
}

/// Sends one request to the worker `policy` picks, retrying on another worker only when the
/// connection was refused (nothing reached the worker), and returns the streaming response.
pub async fn forward(
    up: &Upstreams,
    arm: &Arm,
    route: Route,
    parts: &http::request::Parts,
    body: Bytes,
    info: &RequestInfo,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let snapshot = up.pool.snapshot();
    let workers = eligible(&snapshot, info.model.as_deref())?;
    let cap = up.config.max_inflight_per_worker;
    let mut last_error = ApiError::NoWorker;
    for _attempt in 0..=up.config.connect_retries {
        if cap > 0
            && workers
                .iter()
                .all(|w| !w.is_usable() || w.inflight() >= cap)
            && workers.iter().any(|w| w.is_usable())
        {
            return Err(ApiError::Saturated);
        }
        let policy = arm.policy.as_ref();
        let Some(selection) = policy.select(&workers, info) else {
            return Err(last_error);
        };
        if route != Route::Passthrough {
            up.metrics
                .routing_decisions
                .with_label_values(&[policy.name(), &arm.name, selection.outcome.as_str()])
                .inc();
        }
        let worker = &workers[selection.index];
        let tracker = Tracker {
            slot: worker.acquire(),
            metrics: up.metrics.clone(),
            policy: policy.name(),
            arm: arm.name.clone(),
            started,
            phase: Phase::Waiting,
        };
        let request = upstream_request(
            parts,
            worker.scheme.clone(),
            worker.authority.clone(),
            body.clone(),
        )?;
        let timeout = up.config.timeouts.first_byte();
        match tokio::time::timeout(timeout, up.client.request(request)).await {
            Ok(Ok(resp)) => {
                worker.record_status(
                    resp.status(),
                    up.config.health.passive_failures,
                    Duration::from_secs_f64(up.config.eject_seconds),
                );
                return Ok(tracker.into_response(resp, route, up.config.timeouts.idle_stream()));
            }
            Ok(Err(e)) if e.is_connect() => {
                tracker.failed("connect");
                worker.eject_for(Duration::from_secs_f64(up.config.eject_seconds));
                tracing::warn!(worker = %worker.name, error = %e, "connect failed; trying another worker");
                last_error = ApiError::UpstreamConnect {
                    worker: worker.name.clone(),
                    detail: error_chain(&e),
                };
            }
            Ok(Err(e)) => {
                tracker.failed("request");
                return Err(ApiError::UpstreamFailed {
                    worker: worker.name.clone(),
                    detail: error_chain(&e),
                });
            }
            Err(_) => {
                tracker.failed("timeout");
                return Err(ApiError::UpstreamTimeout {
                    worker: worker.name.clone(),
                    seconds: timeout.as_secs_f64(),
                });
            }
        }
    }
    Err(last_error)
}

/// An error and its sources, joined: hyper's top-level messages alone say little.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

/// Headers that describe one hop and must not be forwarded (RFC 9110 §7.6.1), plus those we set.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// Copies end-to-end headers, dropping hop-by-hop ones and any the `Connection` header names.
fn copy_headers(from: &HeaderMap, to: &mut HeaderMap, also_skip: &[HeaderName]) {
    let named: Vec<String> = from
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .collect();
    for (name, value) in from {
        if is_hop_by_hop(name)
            || also_skip.contains(name)
            || named.iter().any(|n| n == name.as_str())
        {
            continue;
        }
        to.append(name.clone(), value.clone());
    }
}

fn upstream_request(
    parts: &http::request::Parts,
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    body: Bytes,
) -> Result<Request<Full<Bytes>>, ApiError> {
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let uri = Uri::builder()
        .scheme(scheme)
        .authority(authority)
        .path_and_query(path)
        .build()
        .map_err(|e| ApiError::InvalidRequest(format!("cannot build upstream URI: {e}")))?;
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    copy_headers(
        &parts.headers,
        req.headers_mut(),
        &[header::HOST, header::CONTENT_LENGTH],
    );
    Ok(req)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Waiting,
    Streaming,
    Finished,
}

/// One request's accounting; see the module docs.
struct Tracker {
    slot: InflightGuard,
    metrics: Metrics,
    policy: &'static str,
    arm: std::sync::Arc<str>,
    started: Instant,
    phase: Phase,
}

impl Tracker {
    fn worker(&self) -> &str {
        &self.slot.worker().name
    }

    /// The request failed upstream before a response; the caller answers with an error.
    fn failed(mut self, kind: &str) {
        self.upstream_error(kind);
        self.phase = Phase::Finished;
    }

    fn upstream_error(&self, kind: &str) {
        self.metrics
            .upstream_errors
            .with_label_values(&[self.worker(), kind])
            .inc();
    }

    fn into_response(
        mut self,
        resp: http::Response<Incoming>,
        route: Route,
        idle: Duration,
    ) -> Response {
        let (parts, incoming) = resp.into_parts();
        let worker = self.worker().to_owned();
        let arm = self.arm.clone();
        self.metrics
            .ttfb
            .with_label_values(&[self.policy, &self.arm, &worker])
            .observe(self.started.elapsed().as_secs_f64());
        self.metrics
            .requests
            .with_label_values(&[
                route.as_str(),
                self.policy,
                &self.arm,
                &worker,
                parts.status.as_str(),
            ])
            .inc();
        self.phase = if incoming.is_end_stream() {
            Phase::Finished
        } else {
            Phase::Streaming
        };
        let mut out = Response::new(Body::new(RelayBody {
            inner: incoming,
            idle_timer: Box::pin(tokio::time::sleep(idle)),
            idle,
            tracker: (self.phase == Phase::Streaming).then_some(self),
        }));
        *out.status_mut() = parts.status;
        copy_headers(&parts.headers, out.headers_mut(), &[]);
        if let Ok(v) = HeaderValue::from_str(&worker) {
            out.headers_mut().insert(WORKER_HEADER, v);
        }
        if let Ok(v) = HeaderValue::from_str(&arm) {
            out.headers_mut().insert(ARM_HEADER, v);
        }
        out
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        let phase = match self.phase {
            Phase::Finished => None,
            Phase::Waiting => Some("waiting"),
            Phase::Streaming => Some("streaming"),
        };
        if let Some(phase) = phase {
            self.metrics
                .client_disconnects
                .with_label_values(&[phase])
                .inc();
            self.metrics
                .upstream_aborts
                .with_label_values(&[self.worker()])
                .inc();
            tracing::debug!(worker = %self.worker(), phase, "client went away; upstream request dropped");
        }
        self.metrics
            .duration
            .with_label_values(&[self.policy, &self.arm, self.worker()])
            .observe(self.started.elapsed().as_secs_f64());
    }
}

#[derive(Debug, thiserror::Error)]
#[error("worker sent nothing for {0:?}; stream closed")]
struct IdleTimeout(Duration);

/// The upstream body, relayed frame by frame with no buffering, ended early if the worker goes silent.
struct RelayBody {
    inner: Incoming,
    idle_timer: Pin<Box<Sleep>>,
    idle: Duration,
    /// `Some` until the stream ends; dropping it (with the body) settles the accounting.
    tracker: Option<Tracker>,
}

impl RelayBody {
    fn finish(&mut self, error_kind: Option<&str>) {
        if let Some(mut t) = self.tracker.take() {
            if let Some(kind) = error_kind {
                t.upstream_error(kind);
            }
            t.phase = Phase::Finished;
        }
    }
}

impl HttpBody for RelayBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if this.inner.is_end_stream() {
                    // hyper may not poll again once the body says it is complete.
                    this.finish(None);
                } else {
                    let deadline = Instant::now() + this.idle;
                    this.idle_timer.as_mut().reset(deadline);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.finish(Some("body"));
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) => {
                this.finish(None);
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.tracker.is_some() && this.idle_timer.as_mut().poll(cx).is_ready() {
                    this.finish(Some("idle_timeout"));
                    return Poll::Ready(Some(Err(IdleTimeout(this.idle).into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Shared handle used by the handlers.
pub type SharedUpstreams = Arc<Upstreams>;
