//! Thin HTTP handlers: read the body within its limit, compute the routing key, hand over to the proxy.
//!
//! Here: the handlers' shared state and the routed request path (completions and chats, the
//! passthrough, the debug route); beside it the Responses API's handlers (`responses_api`), what
//! the gateway answers itself (`gateway`: models, health, readiness, metrics) and the checks
//! every request passes first (`guard`).

mod gateway;
mod guard;
mod responses_api;

use std::{future::Future, sync::Arc, task::Poll};

use axum::{
    body::Body,
    extract::{Request, State},
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    Json,
};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::{
    config::RoutingConfig,
    error::{error_response, ApiError},
    loop_copy::{Handle, LoopCopy},
    policy::arms::{Arms, HeldArm},
    proxy::{forward, Route, Upstreams},
    routing_key::{self, PromptField, RequestInfo},
    workers::{LoopSet, WorkerSet},
};

pub use gateway::{health, metrics, models, ready};
pub use guard::{authenticate, check_head, guard, method_not_allowed, not_found};
pub use responses_api::{responses_create, stored_response};
/// Shared state of the handlers; every request clones it, so it is one reference count.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl AppState {
    pub fn from_shared(shared: Shared) -> Self {
        Self(Arc::new(shared))
    }

    /// The same state for one more event loop: each loop serves with its own, so that the
    /// reference counts a request writes (this state's, and its handles on the arms and the
    /// workers) are that loop's alone ([`crate::loop_copy`]).
    pub fn for_loop(&self) -> Self {
        Self::from_shared(Shared {
            upstreams: Arc::clone(&self.upstreams),
            arms: Arc::clone(&self.arms),
            routing_config: Arc::clone(&self.routing_config),
            passthrough: self.passthrough.for_loop(),
            resolver: Arc::clone(&self.resolver),
            responses: Arc::clone(&self.responses),
            here: Here::default(),
        })
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// What [`AppState`] holds.
pub struct Shared {
    pub upstreams: Arc<Upstreams>,
    /// The routing arms (one, unless an A/B split is configured); swapped whole on a config
    /// reload, while requests in flight keep the arms they started with.
    pub arms: Arc<arc_swap::ArcSwap<Arms>>,
    /// The config the current arms were built from (what a reload compares against).
    pub routing_config: Arc<arc_swap::ArcSwap<RoutingConfig>>,
    /// Picks the worker for paths that carry no prompt.
    pub passthrough: HeldArm,
    /// Name resolution for `dns` discovery (replaceable in tests).
    pub resolver: Arc<dyn crate::discovery::Resolve>,
    /// Which worker holds each stored Responses API response this gateway has seen.
    pub responses: Arc<crate::responses::Homes>,
    /// This event loop's handles on the arms and the workers.
    pub here: Here,
}

/// An event loop's handles on the snapshots its requests hold ([`crate::loop_copy`]).
#[derive(Default)]
pub struct Here {
    arms: LoopCopy<Arms>,
    workers: LoopCopy<WorkerSet, LoopSet>,
}

impl Shared {
    /// The current arms, held for a request.
    pub fn arms_now(&self) -> Handle<Arms> {
        self.here.arms.get(&self.arms)
    }

    /// The current workers, held for a request.
    pub fn workers_now(&self) -> Arc<LoopSet> {
        self.upstreams.pool.snapshot_in(&self.here.workers)
    }
}

pub async fn completions(State(s): State<AppState>, req: Request) -> Response {
    completion(s, Completion::Text, req).await
}

pub async fn chat_completions(State(s): State<AppState>, req: Request) -> Response {
    completion(s, Completion::Chat, req).await
}

/// The two routes that carry a prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// `POST /v1/completions`
    Text,
    /// `POST /v1/chat/completions`
    Chat,
}

impl Completion {
    /// The completion route a request's method and path name, if any.
    pub fn of(method: &http::Method, path: &str) -> Option<Self> {
        if method != http::Method::POST {
            return None;
        }
        match path {
            "/v1/completions" => Some(Completion::Text),
            "/v1/chat/completions" => Some(Completion::Chat),
            _ => None,
        }
    }
}

/// The handler of both completion routes.
pub async fn completion(s: AppState, route: Completion, req: Request) -> Response {
    match route {
        Completion::Text => routed(s, Route::Completions, PromptField::Prompt, req).await,
        Completion::Chat => routed(s, Route::ChatCompletions, PromptField::Messages, req).await,
    }
}

async fn routed(s: AppState, route: Route, field: PromptField, req: Request) -> Response {
    let up = &s.upstreams;
    let arms = s.arms_now();
    let (parts, body) = req.into_parts();
    let (body, info) = match keyed(up, &parts, body, field).await {
        Ok(x) => x,
        Err(e) => return respond(&s, route, arms.unpicked_labels(), Err(e)),
    };
    let arm = Arms::pick_held(&arms, &parts.headers, &info);
    let result = forward(up, &s.workers_now(), &arm, route, &parts, body, info).await;
    respond(&s, route, (arm.policy.name(), &arm.name), result)
}

/// `POST /debug/route/v1/completions` (and `.../chat/completions`): where the request would be
/// routed now and why, without sending it and without changing any routing state. For
/// operators ("why did this go there?") and for checking that replicas agree.
pub async fn debug_route_completions(State(s): State<AppState>, req: Request) -> Response {
    debug_route(s, PromptField::Prompt, req).await
}

pub async fn debug_route_chat(State(s): State<AppState>, req: Request) -> Response {
    debug_route(s, PromptField::Messages, req).await
}

async fn debug_route(s: AppState, field: PromptField, req: Request) -> Response {
    let up = &s.upstreams;
    let arms = s.arms.load_full();
    let (parts, body) = req.into_parts();
    let answer = async {
        let (_, info) = keyed(up, &parts, body, field).await?;
        let arm = arms.pick(&parts.headers, &info);
        let snapshot = up.pool.snapshot();
        let workers = crate::workers::eligible(&snapshot, info.model.as_deref())?;
        let Some(peeked) = arm.policy.peek(&workers, &info) else {
            return Ok(None);
        };
        Ok::<_, ApiError>(Some(serde_json::json!({
            "policy": arm.policy.name(),
            "arm": &*arm.name,
            "worker": &*workers[peeked.index].name,
            "outcome": peeked.outcome.as_str(),
            "prompt_tokens": peeked.prediction.map(|p| p.prompt_tokens),
            "predicted_cached_tokens": peeked.prediction.map(|p| p.cached_tokens),
            "tokenized": info.tokens.is_some(),
            // Token ids routing had: the whole prompt's, or the head's when no worker's events
            // reached past it (then `prompt_tokens` is partly an estimate).
            "tokens_encoded": info.tokens.as_ref().map(|t| t.len()),
        })))
    };
    match answer.await {
        Ok(Some(v)) => Json(v).into_response(),
        Ok(None) => error_response(
            StatusCode::NOT_IMPLEMENTED,
            "NotImplementedError",
            "this arm's policy cannot say where a request would go without routing it",
            None,
        ),
        Err(e) => e.into_response(),
    }
}

/// The request's body, read within the limits, and what routing needs of it ([`key`]).
async fn keyed(
    up: &crate::proxy::Upstreams,
    parts: &http::request::Parts,
    body: Body,
    field: PromptField,
) -> Result<(Bytes, RequestInfo), ApiError> {
    let body = read_body(&parts.headers, body, up).await?;
    let info = key(up, &body, field).await?;
    Ok((body, info))
}

/// What routing needs of a body: the routing key and, when a tokenizer is configured for its
/// model, its token ids.
async fn key(
    up: &crate::proxy::Upstreams,
    body: &[u8],
    field: PromptField,
) -> Result<RequestInfo, ApiError> {
    let mut info = routing_key::extract(body, field, &up.config.routing_key)?;
    if !up.tokenizers.is_empty() {
        crate::request_tokens::attach(up, &mut info, body, field).await;
    }
    Ok(info)
}

/// vLLM's serving routes outside `/v1/` (its tokenizer, pooling, scoring and SageMaker APIs),
/// passed through as the other `/v1/*` paths are; the same in [`needs_client_key`]. Not its
/// operator routes (`/reset_prefix_cache`, `/sleep`, `/wake_up`, profiling, `/load`,
/// `/metrics`, ...): sent to one worker of many they would act on that one alone, so they stay
/// the operator's, on each worker.
pub const VLLM_SERVING_PATHS: &[&str] = &[
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/invocations",
];

/// vLLM's serving prefixes other than `/v1/` (`/v2/rerank`, `/inference/v1/generate`).
pub const VLLM_SERVING_PREFIXES: &[&str] = &["/v2/", "/inference/"];

/// Whether client keys, where configured, guard `path`: every path the gateway proxies to a
/// worker, and the routing debug routes. Not the probes (`/health`, `/ready`, `/metrics`).
pub fn needs_client_key(path: &str) -> bool {
    path.starts_with("/v1/")
        || path.starts_with("/debug/")
        || VLLM_SERVING_PREFIXES.iter().any(|p| path.starts_with(p))
        || VLLM_SERVING_PATHS.contains(&path)
}

/// Any other `/v1/*` path, and vLLM's serving routes outside it ([`VLLM_SERVING_PATHS`]), sent
/// as they are to the least-loaded worker; to one that serves the body's `model`, when the body
/// is a JSON object that names one and the workers list theirs (404 when none does, as for a
/// completion).
pub async fn passthrough(State(s): State<AppState>, req: Request) -> Response {
    let up = &s.upstreams;
    let (parts, body) = req.into_parts();
    let result = async {
        let body = read_body(&parts.headers, body, up).await?;
        let info = RequestInfo {
            model: named_model(&parts.headers, &body),
            ..RequestInfo::unkeyed()
        };
        let workers = s.workers_now();
        forward(
            up,
            &workers,
            &s.passthrough,
            Route::Passthrough,
            &parts,
            body,
            info,
        )
        .await
    }
    .await;
    let labels = (s.passthrough.policy.name(), &*s.passthrough.name);
    respond(&s, Route::Passthrough, labels, result)
}

/// The `model` a JSON request body names, if it is a JSON object with a string `model`;
/// anything else (not JSON, a multipart upload, invalid) names none and is left for the worker
/// to judge, as before the gateway looked.
fn named_model(headers: &http::HeaderMap, body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named<'a> {
        #[serde(borrow, default)]
        model: Option<std::borrow::Cow<'a, str>>,
    }
    const JSON: &[u8] = b"application/json";
    let json = headers.get(header::CONTENT_TYPE).is_none_or(|v| {
        let v = v.as_bytes().trim_ascii_start();
        v.get(..JSON.len())
            .is_some_and(|p| p.eq_ignore_ascii_case(JSON))
    });
    if !json || body.trim_ascii_start().first() != Some(&b'{') {
        return None;
    }
    let named: Named = serde_json::from_slice(body).ok()?;
    named.model.map(std::borrow::Cow::into_owned)
}

/// Counts gateway-made errors (proxied responses are counted by the proxy) and renders them.
fn respond(
    s: &AppState,
    route: Route,
    (policy, arm): (&str, &str),
    result: Result<Response, ApiError>,
) -> Response {
    match result {
        Ok(resp) => resp,
        Err(e) => {
            let status = e.status_and_type().0;
            s.upstreams
                .metrics
                .requests
                .with_label_values(&[
                    route.as_str(),
                    policy,
                    arm,
                    e.worker().unwrap_or("none"),
                    status.as_str(),
                ])
                .inc();
            static FAILED: crate::logging::Throttle = crate::logging::Throttle::new(10);
            // Shed load is expected under overload: counted in kvroute_shed_total, not logged.
            let shed = matches!(e, ApiError::QueueFull | ApiError::QueueTimeout(_));
            if status.is_server_error() && !shed {
                if let Some(suppressed) = FAILED.allow() {
                    tracing::warn!(route = route.as_str(), error = %e, suppressed, "request failed");
                }
            }
            let mut resp = e.into_response();
            // Every response names its arm, the gateway's own errors too (none before an arm is picked).
            if let Ok(v) = http::HeaderValue::from_str(arm) {
                if arm != "none" {
                    resp.headers_mut()
                        .insert(crate::policy::arms::ARM_HEADER, v);
                }
            }
            resp
        }
    }
}

/// The whole body, within the size limit and the body read timeout.
async fn read_body(
    headers: &http::HeaderMap,
    body: Body,
    up: &Upstreams,
) -> Result<Bytes, ApiError> {
    let limit = up.config.body_limit_bytes;
    let timeout = up.times.body_read;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    // A small body has usually arrived with the head: read at once, it needs no timer.
    let mut collect = std::pin::pin!(Limited::new(body, limit).collect());
    let collected = match std::future::poll_fn(|cx| Poll::Ready(collect.as_mut().poll(cx))).await {
        Poll::Ready(collected) => collected,
        Poll::Pending => tokio::time::timeout(timeout, collect)
            .await
            .map_err(|_| ApiError::BodyTimeout(timeout.as_secs_f64()))?,
    };
    match collected {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(ApiError::BodyTooLarge { limit })
        }
        Err(e) => Err(ApiError::InvalidRequest(format!(
            "could not read the request body: {e}"
        ))),
    }
}
