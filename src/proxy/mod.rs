//! The proxy stage: pick a worker with a policy, send the request over a pooled hyper client,
//! and relay the response body frame by frame with an in-flight tracker attached to it
//! (`relay.rs`).
//!
//! The tracker is the request's accounting: it holds the worker's in-flight slot, and when it is
//! dropped it releases the slot exactly once and records how the request ended. Dropped before
//! it was marked finished means the client went away (while waiting for headers, or while the
//! body streamed); dropping it also drops the upstream connection, which is how vLLM learns to
//! abort the generation.

mod relay;

use std::{borrow::Cow, sync::Arc, time::Duration};

use axum::response::Response;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, Request, Uri};
use http_body_util::Full;
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::TokioExecutor,
};
use tokio::time::Instant;

use relay::{Feedback, Phase, Tracker};

use crate::{
    admission::{self, Shed},
    config::Config,
    error::ApiError,
    load::RequestLoad,
    metrics::Metrics,
    policy::arms::Arm,
    routing_key::RequestInfo,
    workers::{eligible, Pool, Worker},
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

thread_local! {
    /// The connection pool of an event loop that has its own (see `server::serve_state_on`).
    static OWN_CLIENT: std::cell::OnceCell<HttpClient> = const { std::cell::OnceCell::new() };
}

/// Gives the calling thread's event loop its own pool of connections to the workers, so a
/// request and its upstream connection stay on one thread. For a thread that serves one gateway.
pub fn use_own_client(cfg: &Config) {
    OWN_CLIENT.with(|c| {
        let _ = c.set(http_client(cfg));
    });
}

/// Everything the proxy stage needs, shared by all requests.
pub struct Upstreams {
    pub pool: Pool,
    pub client: HttpClient,
    pub metrics: Metrics,
    pub config: Config,
    /// Client keys and the key sent to workers.
    pub auth: crate::auth::Auth,
    /// Tokenizers by served model (`tokenizers` in the config), loaded at start-up.
    pub tokenizers: std::collections::HashMap<String, Arc<crate::tokenize::ModelTokenizer>>,
}

/// Which kind of request this is, for the `route` label and for whether routing is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Completions = 0,
    ChatCompletions = 1,
    Passthrough = 2,
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
    info: RequestInfo,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let snapshot = up.pool.snapshot();
    let workers = eligible(&snapshot, info.model.as_deref())?;
    let cap = up.config.max_inflight_per_worker;
    let mut last_error = ApiError::NoWorker;
    // The request's key, shared with the trackers of learning policies (made on first need).
    let mut shared: Option<Arc<RequestInfo>> = None;
    // Refused connections retried so far, and choices lost to a concurrent request.
    let (mut refused, mut lost) = (0, 0);
    loop {
        if cap > 0 {
            admit(up, &workers, info.model.as_deref().unwrap_or(""), cap).await?;
        }
        // With a per-worker cap, the policy chooses among the workers under it.
        let open: Cow<[Arc<Worker>]> = if cap == 0 {
            Cow::Borrowed(&workers)
        } else {
            Cow::Owned(
                workers
                    .iter()
                    .filter(|w| w.inflight() < cap)
                    .cloned()
                    .collect(),
            )
        };
        let policy = arm.policy.as_ref();
        let Some(selection) = policy.select(&open, &info) else {
            return Err(last_error);
        };
        let worker = &open[selection.index];
        // Taken before anything else is counted, so the cap holds under concurrent choices.
        let Some(slot) = worker.try_acquire(cap) else {
            // Another request took the last slot between the choice and here: go back through
            // admission (which queues, when configured) and choose again. Bounded, so a request
            // that keeps losing is refused rather than spinning.
            lost += 1;
            if lost > MAX_LOST_CHOICES {
                up.metrics.shed.with_label_values(&["lost_choices"]).inc();
                return Err(ApiError::AtCapacity);
            }
            continue;
        };
        if route != Route::Passthrough {
            arm.count_decision(&up.metrics, selection.outcome);
        }
        let feedback = policy.learns().then(|| Feedback {
            policy: Arc::clone(&arm.policy),
            info: Arc::clone(shared.get_or_insert_with(|| Arc::new(info.clone()))),
            selection,
            load: RequestLoad::new(
                worker,
                selection.prediction.map_or(0, |p| u64::from(p.uncached())),
                selection
                    .prediction
                    .map_or(0, |p| u64::from(p.prompt_tokens)),
            ),
            usage: None,
            failed: false,
        });
        let tracker = Tracker {
            series: worker.series(policy.name(), &arm.name),
            slot,
            metrics: up.metrics.clone(),
            started,
            phase: Phase::Waiting,
            feedback,
        };
        let mut request = upstream_request(
            parts,
            worker.scheme.clone(),
            worker.authority.clone(),
            body.clone(),
        )?;
        if let Some(key) = &up.auth.worker_authorization {
            // The gateway's own key: the client's never reaches a worker.
            request
                .headers_mut()
                .insert(header::AUTHORIZATION, key.clone());
        }
        let timeout = up.config.timeouts.first_byte();
        let sent = OWN_CLIENT.with(|own| own.get().unwrap_or(&up.client).request(request));
        match tokio::time::timeout(timeout, sent).await {
            Ok(Ok(resp)) => {
                worker.record_status(
                    resp.status(),
                    up.config.health.passive_failures,
                    Duration::from_secs_f64(up.config.eject_seconds),
                );
                return Ok(tracker.into_response(resp, route, up.config.timeouts.idle_stream()));
            }
            Ok(Err(e)) if e.is_connect() && out_of_descriptors(&e) => {
                // The gateway's own failure (too many open files): not the worker's fault.
                tracker.failed("gateway_fd_exhausted");
                return Err(ApiError::GatewayExhausted(error_chain(&e)));
            }
            Ok(Err(e)) if e.is_connect() => {
                tracker.failed("connect");
                worker.eject_for(Duration::from_secs_f64(up.config.eject_seconds));
                static CONNECT: crate::logging::Throttle = crate::logging::Throttle::new(10);
                if let Some(suppressed) = CONNECT.allow() {
                    tracing::warn!(worker = %worker.name, error = %e, suppressed, "connect failed; trying another worker");
                }
                last_error = ApiError::UpstreamConnect {
                    worker: worker.name.clone(),
                    detail: error_chain(&e),
                };
                refused += 1;
                if refused > up.config.connect_retries {
                    return Err(last_error);
                }
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
                // Repeated timeouts eject a hung worker, as repeated 5xx do.
                worker.record_status(
                    http::StatusCode::GATEWAY_TIMEOUT,
                    up.config.health.passive_failures,
                    Duration::from_secs_f64(up.config.eject_seconds),
                );
                return Err(ApiError::UpstreamTimeout {
                    worker: worker.name.clone(),
                    seconds: timeout.as_secs_f64(),
                });
            }
        }
    }
}

/// How many times in a row a request may find its chosen worker's last slot taken by another
/// request before it is refused (503).
const MAX_LOST_CHOICES: usize = 8;

/// Admission control under a per-worker cap: returns at once while some usable worker has room
/// and nobody is queued for the same model; otherwise waits in the model's bounded line (see
/// [`crate::admission`]), or answers 503 when there is no queue, it is full, or the wait ran out.
/// With no usable worker at all it returns, so the caller answers as for an unhealthy pool.
async fn admit(
    up: &Upstreams,
    workers: &[Arc<Worker>],
    model: &str,
    cap: usize,
) -> Result<(), ApiError> {
    let room = || workers.iter().any(|w| w.is_usable() && w.inflight() < cap);
    let adm = &up.config.admission;
    let freed = &up.pool.freed;
    if room() && !admission::must_queue(freed, model, adm) {
        return Ok(());
    }
    if !workers.iter().any(|w| w.is_usable()) {
        return Ok(());
    }
    let m = &up.metrics;
    match admission::wait_for_slot(freed, model, adm, room).await {
        Ok(waited) => {
            m.queue_wait
                .with_label_values(&["admitted"])
                .observe(waited.as_secs_f64());
            Ok(())
        }
        Err(shed) => {
            m.shed.with_label_values(&[shed.as_str()]).inc();
            Err(match shed {
                Shed::QueueFull => ApiError::QueueFull,
                Shed::WaitTimeout => {
                    m.queue_wait
                        .with_label_values(&["timed_out"])
                        .observe(adm.max_wait_seconds);
                    ApiError::QueueTimeout(adm.max_wait_seconds)
                }
            })
        }
    }
}

/// Whether `e` comes from this process running out of file descriptors (`EMFILE`, `ENFILE`).
fn out_of_descriptors(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if matches!(io.raw_os_error(), Some(23 | 24)) {
                return true;
            }
        }
        cur = err.source();
    }
    false
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
pub(super) fn copy_headers(from: &HeaderMap, to: &mut HeaderMap, also_skip: &[HeaderName]) {
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

/// Shared handle used by the handlers.
pub type SharedUpstreams = Arc<Upstreams>;
