//! The proxy stage: pick a worker with a policy, send the request over a kept-alive connection
//! to it (`upstream.rs`), and relay the response body frame by frame with an in-flight tracker
//! attached to it (`relay.rs`).
//!
//! The tracker is the request's accounting: it holds the worker's in-flight slot, and when it is
//! dropped it releases the slot exactly once and records how the request ended. Dropped before
//! it was marked finished means the client went away (while waiting for headers, or while the
//! body streamed); dropping it also drops the upstream connection, which is how vLLM learns to
//! abort the generation.

mod http1;
mod relay;
mod upstream;

use std::{borrow::Cow, sync::Arc, time::Duration};

use axum::response::Response;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue};
use http_body_util::Full;
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::TokioExecutor,
};
use tokio::time::Instant;

pub use http1::UpstreamBody;
use relay::{Feedback, Opening, Phase, Tracker, UsageNames, UsageRead};
pub use upstream::Connections;

use crate::{
    admission::{self, Shed},
    config::Config,
    error::ApiError,
    load::RequestLoad,
    metrics::Metrics,
    policy::arms::{Arm, HeldArm},
    policy::Selection,
    routing_key::RequestInfo,
    workers::{eligible, HeldWorker, InflightGuard, LoopSet, Pool, Worker},
};

/// Response header naming the worker that served the request.
pub const WORKER_HEADER: &str = "x-kvroute-worker";

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn http_client(cfg: &Config) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(cfg.timeouts.connect()));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(cfg.timeouts.worker_idle())
        .build(connector)
}

thread_local! {
    /// The connections of an event loop that has its own (see `server::serve_state_on`).
    static OWN_CONNECTIONS: std::cell::OnceCell<Arc<Connections>> = const { std::cell::OnceCell::new() };
}

/// Gives the calling thread's event loop its own connections to the workers, so a request and
/// its upstream connection stay on one thread. For a thread that serves one gateway.
pub fn use_own_connections(cfg: &Config) {
    OWN_CONNECTIONS.with(|c| {
        let _ = c.set(Arc::new(Connections::new(
            cfg.timeouts.connect(),
            cfg.timeouts.worker_idle(),
        )));
    });
}

/// Everything the proxy stage needs, shared by all requests.
pub struct Upstreams {
    pub pool: Pool,
    /// For the gateway's own requests to workers (health, load, model lists).
    pub client: HttpClient,
    /// Proxied requests' connections, when the event loop has none of its own.
    pub connections: Connections,
    pub metrics: Metrics,
    pub config: Config,
    /// The config's durations that every request uses, converted once.
    pub times: RequestTimes,
    /// Client keys and the key sent to workers.
    pub auth: crate::auth::Auth,
    /// Tokenizers by served model (`tokenizers` in the config), loaded at start-up.
    pub tokenizers: std::collections::HashMap<String, Arc<crate::tokenize::ModelTokenizer>>,
}

/// The config's durations on every request's path, converted from its seconds once rather than
/// for each request.
#[derive(Clone, Copy, Debug)]
pub struct RequestTimes {
    pub first_byte: Duration,
    pub idle_stream: Duration,
    pub eject: Duration,
    pub body_read: Duration,
}

impl RequestTimes {
    pub fn of(cfg: &Config) -> Self {
        Self {
            first_byte: cfg.timeouts.first_byte(),
            idle_stream: cfg.timeouts.idle_stream(),
            eject: Duration::from_secs_f64(cfg.eject_seconds),
            body_read: Duration::from_secs_f64(cfg.limits.body_read_timeout_seconds),
        }
    }
}

/// Which kind of request this is, for the `route` label and for whether routing is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Completions = 0,
    ChatCompletions = 1,
    Passthrough = 2,
    /// `POST /v1/responses`
    Responses = 3,
}

impl Route {
    pub fn as_str(self) -> &'static str {
        match self {
            Route::Completions => "completions",
            Route::ChatCompletions => "chat_completions",
            Route::Passthrough => "passthrough",
            Route::Responses => "responses",
        }
    }
}

/// Sends one request to the worker `arm`'s policy picks among `pool` (the pool's workers, as
/// the request's event loop holds them), retrying on another worker only when the connection
/// was refused (nothing reached the worker), and returns the streaming response.
pub async fn forward(
    up: &Upstreams,
    pool: &LoopSet,
    arm: &HeldArm,
    route: Route,
    parts: &http::request::Parts,
    body: Bytes,
    info: RequestInfo,
) -> Result<Response, ApiError> {
    let workers = eligible(pool, info.model.as_deref())?;
    send_among(up, arm, route, parts, body, info, (pool, &workers), true).await
}

/// [`forward`] to `worker` alone (where a stored response lives), with the same admission,
/// accounting and health as any request; `arm`'s decision is not counted, since nothing was
/// chosen. 503 when that worker is known down, 502 when it does not answer: never another.
#[allow(clippy::too_many_arguments)]
pub async fn forward_to(
    up: &Upstreams,
    arm: &HeldArm,
    route: Route,
    parts: &http::request::Parts,
    body: Bytes,
    info: RequestInfo,
    pool: &LoopSet,
    worker: &Arc<Worker>,
) -> Result<Response, ApiError> {
    let only = std::slice::from_ref(worker);
    send_among(up, arm, route, parts, body, info, (pool, only), false).await
}

/// Sends the request to the worker `arm`'s policy picks among `workers`, some of `pool`
/// (counting its decision when `decided`), as [`forward`] describes.
#[allow(clippy::too_many_arguments)]
async fn send_among(
    up: &Upstreams,
    arm: &HeldArm,
    route: Route,
    parts: &http::request::Parts,
    body: Bytes,
    info: RequestInfo,
    (pool, workers): (&LoopSet, &[Arc<Worker>]),
    decided: bool,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    // The request's key, shared with the tracker when the policy learns.
    let info = Arc::new(info);
    let mut last_error = ApiError::NoWorker;
    // Refused connections retried so far, and choices lost to a concurrent request.
    let (mut refused, mut lost) = (0, 0);
    loop {
        let Some(Choice {
            open,
            selection,
            slot,
        }) = choose(up, arm, (pool, workers), &info, &mut lost).await?
        else {
            return Err(last_error);
        };
        if decided && route != Route::Passthrough {
            arm.count_decision(&up.metrics, selection.outcome);
        }
        let worker = &open[selection.index];
        let tracker = tracker(arm, route, slot, selection, &info, started);
        let request = Outgoing {
            parts,
            body: body.clone(),
            // The gateway's own key: the client's never reaches a worker.
            authorization: up.auth.worker_authorization.as_ref(),
        };
        let timeout = up.times.first_byte;
        let own = OWN_CONNECTIONS.with(|own| own.get().cloned());
        let connections = own.as_deref().unwrap_or(&up.connections);
        // A first try that no admission queue held starts when the request did, a few µs ago:
        // the clock is not read again for it.
        let queued = up.config.max_inflight_per_worker > 0;
        let sending = if refused == 0 && !queued {
            started
        } else {
            Instant::now()
        };
        let sent = tokio::time::timeout_at(sending + timeout, connections.send(worker, &request));
        let sent = sent.await;
        match settle(up, worker, tracker, sent, route, timeout) {
            Settled::Answered(resp) => return Ok(resp),
            Settled::Failed(e) => return Err(e),
            Settled::Refused(e) => {
                last_error = e;
                refused += 1;
                if refused > up.config.connect_retries {
                    return Err(last_error);
                }
            }
        }
    }
}

/// A worker chosen for a request, with its in-flight slot taken.
struct Choice<'w> {
    /// The workers the policy chose among; `selection.index` is into these.
    open: Cow<'w, [Arc<Worker>]>,
    selection: Selection,
    slot: InflightGuard,
}

/// Chooses a worker for the request and takes one of its in-flight slots: through admission
/// control when there is a per-worker cap, then the arm's policy among the workers under it.
/// `None` when the policy finds no worker to choose.
async fn choose<'w>(
    up: &Upstreams,
    arm: &Arm,
    (pool, workers): (&LoopSet, &'w [Arc<Worker>]),
    info: &RequestInfo,
    lost: &mut usize,
) -> Result<Option<Choice<'w>>, ApiError> {
    let cap = up.config.max_inflight_per_worker;
    loop {
        if cap > 0 {
            admit(up, workers, info.model.as_deref().unwrap_or(""), cap).await?;
        }
        // With a per-worker cap, the policy chooses among the workers under it.
        let open: Cow<[Arc<Worker>]> = if cap == 0 {
            Cow::Borrowed(workers)
        } else {
            Cow::Owned(
                workers
                    .iter()
                    .filter(|w| w.inflight() < cap)
                    .cloned()
                    .collect(),
            )
        };
        let Some(selection) = arm.policy.select(&open, info) else {
            return Ok(None);
        };
        // Taken before anything else is counted, so the cap holds under concurrent choices.
        let held = HeldWorker::of(pool, &open[selection.index]);
        if let Some(slot) = held.try_acquire(cap) {
            return Ok(Some(Choice {
                open,
                selection,
                slot,
            }));
        }
        // Another request took the last slot between the choice and here: go back through
        // admission (which queues, when configured) and choose again. Bounded, so a request
        // that keeps losing is refused rather than spinning.
        *lost += 1;
        if *lost > MAX_LOST_CHOICES {
            up.metrics.shed.with_label_values(&["lost_choices"]).inc();
            return Err(ApiError::AtCapacity);
        }
    }
}

/// The request's accounting on the chosen worker, with what the policy learns from when the
/// request ends.
fn tracker(
    arm: &HeldArm,
    route: Route,
    slot: InflightGuard,
    selection: Selection,
    info: &Arc<RequestInfo>,
    started: Instant,
) -> Tracker {
    let policy = arm.policy.as_ref();
    let worker = slot.worker();
    let feedback = policy.learns().then(|| Feedback {
        arm: arm.clone(),
        info: Arc::clone(info),
        selection,
        load: RequestLoad::new(
            slot.held().clone(),
            selection.prediction.map_or(0, |p| u64::from(p.uncached())),
            selection
                .prediction
                .map_or(0, |p| u64::from(p.prompt_tokens)),
        ),
        usage: UsageRead::default(),
        names: if route == Route::Responses {
            UsageNames::Responses
        } else {
            UsageNames::Completions
        },
        opening: (route == Route::Responses).then(Opening::default),
        failed: false,
    });
    Tracker {
        series: worker.series(policy.name(), &arm.name),
        slot,
        started,
        phase: Phase::Waiting,
        feedback,
    }
}

/// What a send to a worker gave back: the response head, the send's error, or the first-byte
/// timeout.
type Sent = Result<
    Result<http::Response<UpstreamBody>, upstream::UpstreamError>,
    tokio::time::error::Elapsed,
>;

/// How a send to a worker ended, for [`forward`].
enum Settled {
    /// The worker answered: the response, its body relayed with the tracker attached.
    Answered(Response),
    /// The request failed for good.
    Failed(ApiError),
    /// The connection was refused: nothing reached the worker, so another may take it.
    Refused(ApiError),
}

/// Records how the send to `worker` ended (its health, the tracker's outcome) and says what
/// the request does next.
fn settle(
    up: &Upstreams,
    worker: &Worker,
    tracker: Tracker,
    sent: Sent,
    route: Route,
    timeout: Duration,
) -> Settled {
    let eject = up.times.eject;
    match sent {
        Ok(Ok(resp)) => {
            worker.record_status(resp.status(), up.config.health.passive_failures, eject);
            Settled::Answered(tracker.into_response(resp, route, up.times.idle_stream))
        }
        Ok(Err(e)) if e.is_connect() && out_of_descriptors(&e) => {
            // The gateway's own failure (too many open files): not the worker's fault.
            tracker.failed("gateway_fd_exhausted");
            Settled::Failed(ApiError::GatewayExhausted(error_chain(&e)))
        }
        Ok(Err(e)) if e.is_connect() => {
            tracker.failed("connect");
            worker.eject_for(eject);
            static CONNECT: crate::logging::Throttle = crate::logging::Throttle::new(10);
            if let Some(suppressed) = CONNECT.allow() {
                tracing::warn!(worker = %worker.name, error = %e, suppressed, "connect failed; trying another worker");
            }
            Settled::Refused(ApiError::UpstreamConnect {
                worker: worker.name.clone(),
                detail: error_chain(&e),
            })
        }
        Ok(Err(e)) => {
            tracker.failed("request");
            Settled::Failed(ApiError::UpstreamFailed {
                worker: worker.name.clone(),
                detail: error_chain(&e),
            })
        }
        Err(_) => {
            tracker.failed("timeout");
            // Repeated timeouts eject a hung worker, as repeated 5xx do.
            worker.record_status(
                http::StatusCode::GATEWAY_TIMEOUT,
                up.config.health.passive_failures,
                eject,
            );
            Settled::Failed(ApiError::UpstreamTimeout {
                worker: worker.name.clone(),
                seconds: timeout.as_secs_f64(),
            })
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

/// Headers that describe one hop and must not be forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name)
}

/// The tokens of a list-valued field (`Connection`, `Transfer-Encoding`): split at commas and
/// trimmed, empty ones left out.
fn tokens(value: &[u8]) -> impl DoubleEndedIterator<Item = &[u8]> {
    value
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// Whether a `Connection` token names a field that goes anyway, or is `close`: the tokens it
/// usually holds, which leave no other field to remove.
fn names_no_other_field(token: &[u8]) -> bool {
    token.eq_ignore_ascii_case(b"close")
        || HOP_BY_HOP
            .iter()
            .any(|h| h.as_str().as_bytes().eq_ignore_ascii_case(token))
}

/// The end-to-end headers of `from`: without hop-by-hop ones and those its `Connection` header
/// names, compared without allocating.
pub(super) fn end_to_end(from: &HeaderMap) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
    let has_connection = from.contains_key(header::CONNECTION);
    let named_by_connection = move |name: &HeaderName| {
        from.get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| tokens(v.as_bytes()))
            .any(|listed| listed.eq_ignore_ascii_case(name.as_str().as_bytes()))
    };
    from.iter().filter(move |(name, _)| {
        !(is_hop_by_hop(name) || has_connection && named_by_connection(name))
    })
}

/// What goes to the worker: the client's method, path and end-to-end headers, with the worker
/// as `Host`, the body's length, and the gateway's own key in place of the client's when one is
/// configured.
pub struct Outgoing<'a> {
    pub parts: &'a http::request::Parts,
    pub body: Bytes,
    pub authorization: Option<&'a HeaderValue>,
}

/// Shared handle used by the handlers.
pub type SharedUpstreams = Arc<Upstreams>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::WorkerConfig;

    fn worker(url: &str) -> Worker {
        Worker::new(&WorkerConfig::from_url(url.to_owned()), &Metrics::new()).unwrap()
    }

    fn client_request(head: &[(&str, &str)]) -> http::request::Parts {
        let mut req = http::Request::post("/v1/completions?x=1").body(()).unwrap();
        for (k, v) in head {
            req.headers_mut().append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        req.into_parts().0
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_stay_behind() {
        let parts = client_request(&[
            ("connection", "keep-alive, X-Private"),
            ("connection", " x-other "),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("x-private", "secret"),
            ("x-other", "1"),
            ("x-kept", "a"),
            ("x-kept", "b"),
            ("transfer-encoding", "chunked"),
        ]);
        let kept: Vec<(&str, &str)> = end_to_end(&parts.headers)
            .map(|(k, v)| (k.as_str(), v.to_str().unwrap()))
            .collect();
        assert_eq!(kept, [("x-kept", "a"), ("x-kept", "b")]);
    }

    fn encoded(parts: &http::request::Parts, body: &'static [u8], key: Option<&str>) -> String {
        let key = key.map(|k| HeaderValue::from_str(k).unwrap());
        let out = Outgoing {
            parts,
            body: Bytes::from_static(body),
            authorization: key.as_ref(),
        };
        let w = worker("http://127.0.0.1:8001");
        String::from_utf8(http1::encode_head(&out, &w.host_header, None)).unwrap()
    }

    #[test]
    fn the_upstream_request_names_the_worker_as_host_and_carries_the_bodys_length() {
        let parts = client_request(&[
            ("host", "gateway.example"),
            ("content-length", "999"),
            ("connection", "close"),
            ("x-kept", "a"),
            ("authorization", "Bearer client"),
        ]);
        assert_eq!(
            encoded(&parts, b"hello", None),
            "POST /v1/completions?x=1 HTTP/1.1\r\nx-kept: a\r\nauthorization: Bearer client\r\n\
             host: 127.0.0.1:8001\r\ncontent-length: 5\r\n\r\n"
        );
        // The gateway's own key replaces the client's.
        let head = encoded(&parts, b"hello", Some("Bearer gateway"));
        assert!(
            head.ends_with("authorization: Bearer gateway\r\n\r\n"),
            "{head}"
        );
        assert!(!head.contains("client"), "{head}");
        // A bodyless GET says no length; the scheme's default port is left out of Host.
        let (get, ()) = http::Request::get("/v1/models")
            .body(())
            .unwrap()
            .into_parts();
        let w = worker("http://vllm-0.vllm:80");
        let out = Outgoing {
            parts: &get,
            body: Bytes::new(),
            authorization: None,
        };
        assert_eq!(
            String::from_utf8(http1::encode_head(&out, &w.host_header, None)).unwrap(),
            "GET /v1/models HTTP/1.1\r\nhost: vllm-0.vllm\r\n\r\n"
        );
    }
}
