//! vLLM's HTTP API on top of a server's engine (or its data-parallel ranks' engines): completions
//! and chat (streaming and not), models, tokenize/detokenize, health, load and metrics, plus the
//! configured faults. The answers' shapes are in `answer.rs`; the Responses API is in
//! `responses.rs`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::answer::{complete_response, stream_response, Reply};
use super::data_parallel::{Engines, RankSlot, Refused, RANK_HEADER};
use super::engine::{splitmix, EngineRequest, Event};
use super::metrics::SimMetrics;
use super::request::{self, Reject};
use super::{tokenizer::SimTokenizer, Faults};
use crate::error::error_response;

pub struct WorkerState {
    /// Its engine, or its data-parallel ranks' engines.
    pub engines: Engines,
    pub metrics: Arc<SimMetrics>,
    pub model: String,
    pub max_model_len: usize,
    pub faults: Faults,
    /// Seeds response ids and the fault dice; differs per worker.
    pub seed: u64,
    pub tokenizer: SimTokenizer,
    /// Responses API answers kept, when the store is on.
    pub responses: super::responses::Store,
    /// What `/kv_event_sources` lists: the publisher's endpoints, when it publishes.
    kv_event_sources: Value,
    requests: AtomicU64,
    in_flight: Arc<AtomicUsize>,
}

impl WorkerState {
    pub fn new(
        engines: Engines,
        metrics: Arc<SimMetrics>,
        model: String,
        max_model_len: usize,
        faults: Faults,
        seed: u64,
        tokenizer: SimTokenizer,
    ) -> Self {
        Self {
            engines,
            metrics,
            model,
            max_model_len,
            faults,
            seed,
            tokenizer,
            responses: super::responses::Store::default(),
            kv_event_sources: json!({}),
            requests: AtomicU64::new(0),
            in_flight: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Keeps Responses API answers in this worker's memory, as vLLM does with
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`.
    pub fn with_responses_store(mut self, on: bool) -> Self {
        self.responses = super::responses::Store::new(on);
        self
    }

    /// Lists `sources` (one per data-parallel rank, in rank order) at `/kv_event_sources` as
    /// vLLM lists publishers it binds (the host a wildcard), with vLLM's defaults for what the
    /// simulator does not model.
    pub fn with_kv_event_sources(mut self, sources: &[crate::kv_events::EventSource]) -> Self {
        let wildcard = |endpoint: &str| match endpoint.rsplit_once(':') {
            Some((_, port)) => format!("tcp://*:{port}"),
            None => endpoint.to_owned(),
        };
        let listing: serde_json::Map<String, Value> = sources
            .iter()
            .enumerate()
            .map(|(rank, source)| {
                let config = json!({
                    "enable_kv_cache_events": true,
                    "publisher": "zmq",
                    "endpoint": wildcard(&source.endpoint),
                    "replay_endpoint": source.replay.as_deref().map(wildcard),
                    "buffer_steps": super::events::BUFFER_STEPS,
                    "hwm": 100_000,
                    "max_queue_size": 100_000,
                    "topic": "",
                });
                (rank.to_string(), config)
            })
            .collect();
        self.kv_event_sources = Value::Object(listing);
        self
    }

    /// Counts a request in `/load` until the guard is dropped.
    pub(super) fn admit(&self) -> LoadGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        LoadGuard {
            total: self.in_flight.clone(),
            rank: None,
        }
    }

    /// The request's number on this worker (seeds its ids).
    pub(super) fn next_request(&self) -> u64 {
        self.requests.fetch_add(1, Ordering::Relaxed)
    }
}

pub fn router(state: Arc<WorkerState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/v1/responses", post(super::responses::create))
        .route("/v1/responses/{id}", get(super::responses::retrieve))
        .route("/v1/responses/{id}/cancel", post(super::responses::cancel))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/load", get(load))
        .route("/kv_event_sources", get(kv_event_sources))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        // vLLM's server sets no body limit of its own; axum's default (2 MiB) would answer 413
        // and close mid-upload where vLLM reads the whole request.
        .layer(axum::extract::DefaultBodyLimit::max(SIM_BODY_LIMIT))
        .with_state(state)
}

/// Largest request body the simulated worker reads: beyond any gateway's default limit.
const SIM_BODY_LIMIT: usize = 64 << 20;

fn bad_request(msg: &str) -> Response {
    error_response(StatusCode::BAD_REQUEST, "BadRequestError", msg, None)
}

/// vLLM's 503 for a request that comes in while the engine stops.
pub(super) fn shutting_down() -> Response {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailableError",
        "engine is shutting down",
        None,
    )
}

pub(super) fn reject(r: Reject) -> Response {
    match r {
        Reject::BadRequest(m) => bad_request(&m),
        Reject::Param { message, param } => error_response(
            StatusCode::BAD_REQUEST,
            "BadRequestError",
            &message,
            Some(param),
        ),
        Reject::Json { message, param } => error_response(
            StatusCode::BAD_REQUEST,
            "Bad Request",
            &message,
            Some(&param),
        ),
        Reject::ModelNotFound(m) => {
            error_response(StatusCode::NOT_FOUND, "NotFoundError", &m, Some("model"))
        }
    }
}

/// An unknown path, answered as vLLM's web framework does.
async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"}))).into_response()
}

async fn health(State(s): State<Arc<WorkerState>>) -> Response {
    if s.faults.hang {
        std::future::pending::<()>().await;
    }
    StatusCode::OK.into_response()
}

async fn load(State(s): State<Arc<WorkerState>>) -> Json<Value> {
    Json(json!({"server_load": s.in_flight.load(Ordering::Relaxed)}))
}

async fn kv_event_sources(State(s): State<Arc<WorkerState>>) -> Json<Value> {
    Json(s.kv_event_sources.clone())
}

async fn reset_prefix_cache(State(s): State<Arc<WorkerState>>) -> Json<Value> {
    Json(json!({"success": s.engines.reset_prefix_cache().await}))
}

async fn metrics(State(s): State<Arc<WorkerState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(),
    )
        .into_response()
}

pub(super) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(s): State<Arc<WorkerState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.model, "object": "model", "created": unix_now(), "owned_by": "vllm",
            "root": s.model, "parent": null, "max_model_len": s.max_model_len,
            "permission": [{
                "id": format!("modelperm-{:032x}", splitmix(s.seed)), "object": "model_permission",
                "created": unix_now(), "allow_create_engine": false, "allow_sampling": true,
                "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                "allow_fine_tuning": false, "organization": "*", "group": null, "is_blocking": false
            }]
        }]
    }))
}

async fn tokenize(State(s): State<Arc<WorkerState>>, body: Bytes) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return bad_request(&e.to_string()),
    };
    let special = v
        .get("add_special_tokens")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let tokens = if let Some(p) = v.get("prompt").and_then(Value::as_str) {
        s.tokenizer.encode(p, special)
    } else if let Some(m) = v.get("messages") {
        let messages: Vec<request::Message> = match serde_json::from_value(m.clone()) {
            Ok(m) => m,
            Err(e) => return bad_request(&e.to_string()),
        };
        let options = serde_json::from_value(v.clone()).unwrap_or_default();
        match request::chat_tokens(&messages, &options, &s.tokenizer) {
            Ok(t) => Ok(t),
            Err(r) => return reject(r),
        }
    } else {
        return bad_request("Field required: prompt or messages");
    };
    let tokens = match tokens {
        Ok(t) => t,
        Err(e) => return bad_request(&e.to_string()),
    };
    Json(json!({
        "count": tokens.len(), "max_model_len": s.max_model_len, "tokens": tokens, "token_strs": null
    }))
    .into_response()
}

async fn detokenize(State(s): State<Arc<WorkerState>>, body: Bytes) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return bad_request(&e.to_string()),
    };
    let Some(ids) = v.get("tokens").and_then(Value::as_array) else {
        return bad_request("Field required: tokens");
    };
    let ids: Vec<u32> = ids
        .iter()
        .filter_map(Value::as_u64)
        .map(|i| i as u32)
        .collect();
    match s.tokenizer.decode(&ids) {
        Ok(prompt) => Json(json!({ "prompt": prompt })).into_response(),
        Err(e) => bad_request(&e.to_string()),
    }
}

async fn completions(state: State<Arc<WorkerState>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(state, &headers, body, false).await
}

async fn chat(state: State<Arc<WorkerState>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(state, &headers, body, true).await
}

/// Counts a request in `/load`, and in its rank's place with vLLM's balancer, for as long as
/// its response lives.
pub(super) struct LoadGuard {
    total: Arc<AtomicUsize>,
    rank: Option<RankSlot>,
}

impl LoadGuard {
    /// Queues the request on the rank `headers` name or the balancer picks, holding its place
    /// there with this guard.
    pub(super) fn submit(
        &mut self,
        s: &WorkerState,
        headers: &HeaderMap,
        req: EngineRequest,
    ) -> Result<mpsc::UnboundedReceiver<Event>, Refused> {
        let (events, slot) = s.engines.submit(headers.get(RANK_HEADER), req)?;
        self.rank = Some(slot);
        Ok(events)
    }
}

/// The answer to a request that could not be queued.
pub(super) fn refusal(refused: Refused) -> Response {
    match refused {
        Refused::ShuttingDown => shutting_down(),
        Refused::NoSuchRank { rank, ranks } => error_response(
            StatusCode::BAD_REQUEST,
            "BadRequestError",
            &format!("data_parallel_rank {rank} is out of range [0, {ranks})."),
            None,
        ),
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.total.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn generate(
    State(s): State<Arc<WorkerState>>,
    headers: &HeaderMap,
    body: Bytes,
    chat: bool,
) -> Response {
    let mut load = s.admit();
    let n = s.next_request();
    let f = &s.faults;
    if f.hang {
        std::future::pending::<()>().await;
    }
    if f.added_latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(f.added_latency_ms)).await;
    }
    if f.error_rate > 0.0 {
        let roll = (splitmix(s.seed ^ n) >> 11) as f64 / (1u64 << 53) as f64;
        if roll < f.error_rate {
            return error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                "injected fault: simulated engine error",
                None,
            );
        }
    }
    let parsed = match request::parse(&body)
        .and_then(|b| request::validate(b, chat, &s.tokenizer, &s.model, s.max_model_len))
    {
        Ok(p) => p,
        Err(r) => return reject(r),
    };
    let events = match load.submit(&s, headers, parsed.engine.clone()) {
        Ok(events) => events,
        Err(refused) => return refusal(refused),
    };
    let reply = Reply {
        id: format!(
            "{}-{:016x}",
            if chat { "chatcmpl" } else { "cmpl" },
            splitmix(s.seed ^ n) ^ splitmix(n)
        ),
        created: unix_now(),
        model: s.model.clone(),
        chat,
        include_usage: parsed.include_usage,
        continuous_usage: parsed.continuous_usage,
        prompt_tokens: parsed.engine.prompt.len(),
    };
    if parsed.stream {
        stream_response(reply, events, f.drop_after_tokens, load)
    } else {
        complete_response(reply, events).await
    }
}
