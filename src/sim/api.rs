//! vLLM's HTTP API on top of a server's engine (or its data-parallel ranks' engines): completions
//! and chat (streaming and not), models, tokenize/detokenize, health, load and metrics, plus the
//! configured faults; the Responses API is in `responses.rs`.
//!
//! Response shapes follow vLLM's OpenAI server: SSE events `data: {json}\n\n` ending with
//! `data: [DONE]\n\n`; chat streams open with a `role` delta; the last content chunk carries
//! `finish_reason`; `stream_options.include_usage` adds a final chunk with empty `choices` and the
//! usage, `continuous_usage_stats` puts usage on every chunk. Usage always carries
//! `prompt_tokens_details.cached_tokens`, as vLLM does with `--enable-prompt-tokens-details`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::data_parallel::{Engines, RankSlot, Refused, RANK_HEADER};
use super::engine::{splitmix, EngineRequest, Event};
use super::metrics::SimMetrics;
use super::request::{self, Reject};
use super::{tokenizer::SimTokenizer, Faults};
use crate::error::error_response;

/// What the simulator puts where vLLM names its version and build.
const SYSTEM_FINGERPRINT: &str = "kvroute-sim";

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
        match request::chat_tokens(&messages, &s.tokenizer) {
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

struct Reply {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    include_usage: bool,
    continuous_usage: bool,
    prompt_tokens: usize,
}

impl Reply {
    /// Usage as vLLM 0.32 streams it: chat adds `created_cache_tokens`.
    fn usage(&self, completion: usize, cached: usize) -> Value {
        let mut details = json!({"cached_tokens": cached});
        if self.chat {
            details["created_cache_tokens"] = json!(0);
        }
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": details
        })
    }

    /// Usage as vLLM 0.32 puts it in a whole (non-streamed) answer.
    fn full_usage(&self, completion: usize, cached: usize) -> Value {
        let mut u = self.usage(completion, cached);
        let d = &mut u["prompt_tokens_details"];
        if !self.chat {
            d["created_cache_tokens"] = Value::Null;
        }
        d["multimodal_tokens"] = Value::Null;
        u["completion_tokens_details"] = Value::Null;
        u
    }

    fn chunk(
        &self,
        text: Option<&str>,
        role: bool,
        finish: Option<(&str, Value)>,
        usage: Option<Value>,
    ) -> Bytes {
        let finished = finish.is_some();
        let (reason, stop) = finish.map_or((Value::Null, Value::Null), |(r, s)| (json!(r), s));
        // Field sets as vLLM 0.32 streams them: a chat chunk carries `stop_reason` only when it
        // finishes, and the role chunk no `token_ids` but the request's `prompt_*` fields.
        let choice = if self.chat {
            let mut delta = serde_json::Map::new();
            if role {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            let mut c =
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": reason});
            if finished {
                c["stop_reason"] = stop;
            }
            if !role {
                c["token_ids"] = Value::Null;
            }
            c
        } else {
            json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": reason,
                "stop_reason": stop, "prompt_token_ids": null, "token_ids": null})
        };
        let mut obj = json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if self.chat && role {
            obj["prompt_token_ids"] = Value::Null;
            obj["prompt_text"] = Value::Null;
        }
        if let Some(u) = usage {
            obj["usage"] = u;
        }
        sse(&obj)
    }

    fn usage_chunk(&self, usage: Value) -> Bytes {
        sse(&json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }))
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

struct StreamState {
    reply: Reply,
    events: mpsc::UnboundedReceiver<Event>,
    /// An event taken off the channel early, to be rendered next.
    held: Option<Event>,
    sent_tokens: usize,
    role_sent: bool,
    drop_after: Option<usize>,
    done: bool,
    _load: LoadGuard,
}

impl StreamState {
    /// The SSE bytes for one token (and the finish, when it came in the same engine step).
    fn render(&mut self, text: Option<String>, finish: Option<Event>) -> Bytes {
        let mut out = Vec::new();
        if self.reply.chat && !self.role_sent {
            self.role_sent = true;
            out.push(self.reply.chunk(Some(""), true, None, None));
        }
        if text.is_some() {
            self.sent_tokens += 1;
        }
        match finish {
            Some(Event::Finished {
                reason,
                stop,
                completion_tokens,
                cached_tokens,
                ..
            }) => {
                let usage = self.reply.usage(completion_tokens, cached_tokens);
                let every = self.reply.continuous_usage.then(|| usage.clone());
                let stop = stop.map_or(Value::Null, Value::from);
                out.push(self.reply.chunk(
                    Some(text.as_deref().unwrap_or("")),
                    false,
                    Some((reason.as_str(), stop)),
                    every,
                ));
                if self.reply.include_usage {
                    out.push(self.reply.usage_chunk(usage));
                }
                out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                self.done = true;
            }
            _ => {
                let every = self
                    .reply
                    .continuous_usage
                    .then(|| self.reply.usage(self.sent_tokens, 0));
                out.push(self.reply.chunk(text.as_deref(), false, None, every));
            }
        }
        Bytes::from(out.concat())
    }
}

fn stream_response(
    reply: Reply,
    events: mpsc::UnboundedReceiver<Event>,
    drop_after: Option<usize>,
    load: LoadGuard,
) -> Response {
    let state = StreamState {
        reply,
        events,
        held: None,
        sent_tokens: 0,
        role_sent: false,
        drop_after,
        done: false,
        _load: load,
    };
    let body = stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        let event = match st.held.take() {
            Some(e) => Some(e),
            None => st.events.recv().await,
        };
        // Fail on the event after the k-th token, so the k tokens before it have been flushed.
        if st.drop_after.is_some_and(|k| st.sent_tokens >= k) {
            st.done = true;
            // That event may have been queued already (an engine catching up runs steps back to
            // back): a body that waits once lets the server write out the chunks it has before
            // the error closes the connection.
            tokio::task::yield_now().await;
            let err = std::io::Error::other("injected fault: connection dropped mid-stream");
            return Some((Err(err), st));
        }
        let bytes = match event {
            None => return None,
            Some(Event::Token { text }) => {
                // The engine sends a request's last token and its finish in the same step, so a
                // finish already queued behind a token goes out in its chunk. Whatever else is
                // queued (the next step's token, when the engine ran ahead of this stream) waits
                // for the next chunk.
                let finish = match st.events.try_recv() {
                    Ok(e @ Event::Finished { .. }) => Some(e),
                    Ok(next) => {
                        st.held = Some(next);
                        None
                    }
                    Err(_) => None,
                };
                st.render(Some(text), finish)
            }
            Some(finish) => st.render(None, Some(finish)),
        };
        Some((Ok::<_, std::io::Error>(bytes), st))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn complete_response(reply: Reply, mut events: mpsc::UnboundedReceiver<Event>) -> Response {
    let mut text = String::new();
    while let Some(e) = events.recv().await {
        match e {
            Event::Token { text: t } => text.push_str(&t),
            Event::Finished {
                reason,
                stop,
                completion_tokens,
                cached_tokens,
                ..
            } => {
                let stop = stop.map_or(Value::Null, Value::from);
                // Field sets as in vLLM 0.32's answers.
                let choice = if reply.chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": text,
                        "refusal": null, "annotations": null, "audio": null, "function_call": null,
                        "reasoning": null},
                        "logprobs": null, "finish_reason": reason.as_str(), "stop_reason": stop,
                        "token_ids": null, "routed_experts": null})
                } else {
                    json!({"index": 0, "text": text, "logprobs": null,
                        "finish_reason": reason.as_str(), "stop_reason": stop, "token_ids": null,
                        "prompt_logprobs": null, "prompt_token_ids": null, "routed_experts": null})
                };
                let mut obj = json!({
                    "id": reply.id,
                    "object": if reply.chat { "chat.completion" } else { "text_completion" },
                    "created": reply.created,
                    "model": reply.model,
                    "choices": [choice],
                    "service_tier": null,
                    "system_fingerprint": SYSTEM_FINGERPRINT,
                    "usage": reply.full_usage(completion_tokens, cached_tokens),
                });
                if reply.chat {
                    obj["prompt_logprobs"] = Value::Null;
                    obj["prompt_token_ids"] = Value::Null;
                    obj["prompt_text"] = Value::Null;
                }
                obj["kv_transfer_params"] = Value::Null;
                obj["ec_transfer_params"] = Value::Null;
                obj["metrics"] = Value::Null;
                return Json(obj).into_response();
            }
        }
    }
    error_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        "InternalServerError",
        "engine stopped before the request finished",
        None,
    )
}
