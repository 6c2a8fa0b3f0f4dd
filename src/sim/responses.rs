//! vLLM's Responses API (`/v1/responses`) on the same engine: text in, text out, streaming and
//! not, with vLLM's store when it is on.
//!
//! As vLLM 0.32 does it: `instructions` become a system message, a continued response's stored
//! messages (less their system message) and its output text come next, then the input (a string
//! as a user message; message items as they are, an assistant's as its first part's text). The
//! store (`responses_store`, vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`) is off by default, as in
//! vLLM: a response is then not kept, and continuing it or asking for it is a 404. With it on,
//! the worker keeps every response it made (`store` not false), in its own memory, forever.
//! Answers have vLLM's field sets, and streams its events, in its order.
//!
//! Deviations, stated: no tools, reasoning or background mode (such items and requests get a 400
//! naming what is not simulated); `max_output_tokens` is checked as chat's `max_tokens` is, and
//! its errors name that field; no faults are injected here.

use std::collections::HashMap;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream;
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::api::{unix_now, LoadGuard, WorkerState};
use super::engine::{splitmix, Event};
use super::request::{self, Message, Reject, RequestBody};
use crate::error::error_response;
use std::sync::Arc;

/// The worker's stored responses, when its store is on.
#[derive(Default)]
pub struct Store {
    enabled: bool,
    kept: Mutex<HashMap<String, Stored>>,
}

/// A stored response and the messages it was made from.
struct Stored {
    response: Value,
    messages: Vec<Message>,
}

impl Store {
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            kept: Mutex::default(),
        }
    }
}

#[derive(Deserialize)]
struct ResponsesBody {
    model: Option<String>,
    input: Option<Value>,
    instructions: Option<String>,
    previous_response_id: Option<String>,
    max_output_tokens: Option<i64>,
    #[serde(default)]
    stream: bool,
    store: Option<bool>,
    #[serde(default)]
    background: bool,
    /// vLLM's own field, as on its completions.
    #[serde(default)]
    ignore_eos: bool,
    temperature: Option<f64>,
    top_p: Option<f64>,
}

fn not_found(id: &str) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        &format!("Response with id '{id}' not found."),
        Some("response_id"),
    )
}

fn bad_request(msg: &str, param: Option<&str>) -> Response {
    error_response(StatusCode::BAD_REQUEST, "invalid_request_error", msg, param)
}

/// `GET /v1/responses/{id}`: the stored response, or 404.
pub async fn retrieve(State(s): State<Arc<WorkerState>>, Path(id): Path<String>) -> Response {
    match s.responses.kept.lock().get(&id) {
        Some(kept) => Json(kept.response.clone()).into_response(),
        None => not_found(&id),
    }
}

/// `POST /v1/responses/{id}/cancel`: every simulated response is synchronous, so a stored one
/// cannot be cancelled (vLLM's 400), and an unknown one is a 404.
pub async fn cancel(State(s): State<Arc<WorkerState>>, Path(id): Path<String>) -> Response {
    if s.responses.kept.lock().contains_key(&id) {
        bad_request("Cannot cancel a synchronous response.", Some("response_id"))
    } else {
        not_found(&id)
    }
}

/// `POST /v1/responses`.
pub async fn create(
    State(s): State<Arc<WorkerState>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let mut load = s.admit();
    let req: ResponsesBody = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&format!("invalid request: {e}"), None),
    };
    if req.background {
        return bad_request(
            "background mode is not simulated (vLLM needs its store for it)",
            Some("background"),
        );
    }
    let previous = match &req.previous_response_id {
        None => None,
        Some(id) => match s.responses.kept.lock().get(id) {
            Some(kept) => Some((kept.messages.clone(), output_text(&kept.response))),
            None => return not_found(id),
        },
    };
    let messages = match input_messages(req.instructions.as_deref(), previous, req.input) {
        Ok(m) => m,
        Err(r) => return super::api::reject(r),
    };
    let chat = RequestBody {
        model: req.model,
        messages: Some(messages),
        max_tokens: req.max_output_tokens,
        ignore_eos: req.ignore_eos,
        stream: req.stream,
        temperature: req.temperature,
        top_p: req.top_p,
        ..RequestBody::default()
    };
    let messages_kept = chat.messages.clone();
    let parsed = match request::validate(chat, true, &s.tokenizer, &s.model, s.max_model_len) {
        Ok(p) => p,
        Err(r) => return super::api::reject(r),
    };
    let events = match load.submit(&s, &headers, parsed.engine.clone()) {
        Ok(events) => events,
        Err(refused) => return super::api::refusal(refused),
    };
    let n = s.next_request();
    let answer = Answer {
        id: format!("resp_{:016x}", splitmix(s.seed ^ n) ^ splitmix(n)),
        message_id: format!("msg_{:016x}", splitmix(s.seed ^ n ^ 0x006d_7367)),
        created_at: unix_now(),
        model: s.model.clone(),
        max_output_tokens: parsed.engine.max_tokens,
        previous_response_id: req.previous_response_id,
        instructions: req.instructions,
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        prompt_tokens: parsed.engine.prompt.len(),
        keep: (s.responses.enabled && req.store != Some(false))
            .then(|| (Arc::clone(&s), messages_kept.unwrap_or_default())),
    };
    if parsed.stream {
        stream_answer(answer, events, load)
    } else {
        whole_answer(answer, events).await
    }
}

/// The text of a stored response's output messages, one assistant message each.
fn output_text(response: &Value) -> Vec<String> {
    response["output"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|item| item["type"] == "message")
        .filter_map(|item| item["content"][0]["text"].as_str().map(str::to_owned))
        .collect()
}

/// The messages vLLM builds from a request and the response it continues.
fn input_messages(
    instructions: Option<&str>,
    previous: Option<(Vec<Message>, Vec<String>)>,
    input: Option<Value>,
) -> Result<Vec<Message>, Reject> {
    let mut messages = Vec::new();
    if let Some(text) = instructions.filter(|t| !t.is_empty()) {
        messages.push(Message {
            role: "system".into(),
            content: Some(json!(text)),
            rest: Default::default(),
        });
    }
    if let Some((earlier, output)) = previous {
        messages.extend(earlier.into_iter().filter(|m| m.role != "system"));
        messages.extend(output.into_iter().map(|text| Message {
            role: "assistant".into(),
            content: Some(json!(text)),
            rest: Default::default(),
        }));
    }
    match input {
        Some(Value::String(text)) => messages.push(Message {
            role: "user".into(),
            content: Some(json!(text)),
            rest: Default::default(),
        }),
        Some(Value::Array(items)) => {
            for item in items {
                messages.push(input_item(item)?);
            }
        }
        _ => {
            return Err(Reject::Param {
                message: "Field required: input (a string or a list of items)".into(),
                param: "input",
            })
        }
    }
    Ok(messages)
}

fn input_item(item: Value) -> Result<Message, Reject> {
    let role = item.get("role").and_then(Value::as_str);
    let Some(role) = role else {
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("unknown");
        return Err(Reject::Param {
            message: format!("Unsupported input item type: {kind} (the simulator has no tools)"),
            param: "input",
        });
    };
    let content = match item.get("content") {
        // An assistant's message keeps its first part's text, as vLLM does.
        Some(Value::Array(parts)) if role == "assistant" => parts
            .first()
            .and_then(|p| p.get("text"))
            .cloned()
            .map(Some)
            .ok_or_else(|| Reject::BadRequest("an assistant item needs text".into()))?,
        other => other.cloned(),
    };
    Ok(Message {
        role: role.to_owned(),
        content,
        rest: Default::default(),
    })
}

/// What an answer carries besides the generated text.
struct Answer {
    id: String,
    message_id: String,
    created_at: u64,
    model: String,
    max_output_tokens: usize,
    previous_response_id: Option<String>,
    instructions: Option<String>,
    temperature: f64,
    top_p: f64,
    prompt_tokens: usize,
    /// The worker and the request's messages, when the response is to be stored.
    keep: Option<(Arc<WorkerState>, Vec<Message>)>,
}

/// How the generation ended, for the answer's status and usage.
struct Ending {
    length: bool,
    cached_tokens: usize,
    completion_tokens: usize,
}

impl Answer {
    /// The response object, with vLLM 0.32's fields in its order.
    fn response(&self, output: Value, ended: Option<&Ending>) -> Value {
        let (status, incomplete, usage) = match ended {
            None => ("in_progress", Value::Null, Value::Null),
            Some(e) => (
                if e.length { "incomplete" } else { "completed" },
                if e.length {
                    json!({"reason": "max_output_tokens"})
                } else {
                    Value::Null
                },
                self.usage(e),
            ),
        };
        json!({
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "metadata": null,
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": true,
            "temperature": self.temperature,
            "tool_choice": "none",
            "tools": [],
            "top_p": self.top_p,
            "background": false,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": null,
            "previous_response_id": self.previous_response_id,
            "prompt": null,
            "reasoning": null,
            "service_tier": "auto",
            "status": status,
            "text": null,
            "top_logprobs": null,
            "truncation": "disabled",
            "usage": usage,
            "user": null,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": null,
            "ec_transfer_params": null,
            "input_messages": null,
            "output_messages": null
        })
    }

    fn usage(&self, e: &Ending) -> Value {
        json!({
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": e.cached_tokens, "cache_write_tokens": 0,
                "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": e.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
            "total_tokens": self.prompt_tokens + e.completion_tokens
        })
    }

    /// The output message; `logprobs` is `null` in a finished part and `[]` in one under way.
    fn message(&self, text: &str, done: bool) -> Value {
        let logprobs = if done { Value::Null } else { json!([]) };
        let content = if done || !text.is_empty() {
            json!([{"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}])
        } else {
            json!([])
        };
        json!({"id": self.message_id, "content": content, "role": "assistant",
            "status": if done { "completed" } else { "in_progress" }, "type": "message",
            "phase": null})
    }

    /// The finished response, stored when the store keeps it.
    fn finish(&mut self, text: &str, ended: &Ending) -> Value {
        let response = self.response(json!([self.message(text, true)]), Some(ended));
        if let Some((worker, messages)) = self.keep.take() {
            worker.responses.kept.lock().insert(
                self.id.clone(),
                Stored {
                    response: response.clone(),
                    messages,
                },
            );
        }
        response
    }
}

fn ending(e: &Event) -> Option<Ending> {
    match e {
        Event::Finished {
            reason,
            completion_tokens,
            cached_tokens,
            ..
        } => Some(Ending {
            length: reason.as_str() == "length",
            cached_tokens: *cached_tokens,
            completion_tokens: *completion_tokens,
        }),
        Event::Token { .. } => None,
    }
}

async fn whole_answer(mut answer: Answer, mut events: mpsc::UnboundedReceiver<Event>) -> Response {
    let mut text = String::new();
    while let Some(e) = events.recv().await {
        match (&e, ending(&e)) {
            (Event::Token { text: t }, _) => text.push_str(t),
            (_, Some(ended)) => return Json(answer.finish(&text, &ended)).into_response(),
            _ => {}
        }
    }
    error_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        "InternalServerError",
        "engine stopped before the request finished",
        None,
    )
}

/// The stream under way: the events so far and what is left to say.
struct Streaming {
    answer: Answer,
    events: mpsc::UnboundedReceiver<Event>,
    text: String,
    sequence: u64,
    opened: bool,
    item_added: bool,
    done: bool,
    _load: LoadGuard,
}

impl Streaming {
    fn event(&mut self, kind: &str, mut data: Value) -> String {
        data["sequence_number"] = json!(self.sequence);
        data["type"] = json!(kind);
        self.sequence += 1;
        format!("event: {kind}\ndata: {data}\n\n")
    }

    /// What vLLM sends before generating: the response created and in progress.
    fn opening(&mut self) -> String {
        let response = self.answer.response(json!([]), None);
        let mut out = self.event("response.created", json!({"response": response.clone()}));
        out += &self.event("response.in_progress", json!({"response": response}));
        out
    }

    /// A token's text; the first comes after the message and its text part are added, as vLLM
    /// adds them with its first output.
    fn delta(&mut self, text: &str) -> String {
        let id = self.answer.message_id.clone();
        let mut out = String::new();
        if !self.item_added {
            self.item_added = true;
            let item = self.answer.message("", false);
            let part =
                json!({"annotations": [], "text": "", "type": "output_text", "logprobs": []});
            out += &self.event(
                "response.output_item.added",
                json!({"item": item, "output_index": 0}),
            );
            out += &self.event(
                "response.content_part.added",
                json!({"content_index": 0, "item_id": id, "output_index": 0, "part": part}),
            );
        }
        self.text.push_str(text);
        out += &self.event(
            "response.output_text.delta",
            json!({"content_index": 0, "delta": text, "item_id": id, "logprobs": [],
                "output_index": 0}),
        );
        out
    }

    /// What vLLM sends once generation ends: the text, part and item done, then the response.
    fn closing(&mut self, ended: &Ending) -> String {
        let id = self.answer.message_id.clone();
        let text = std::mem::take(&mut self.text);
        let item = self.answer.message(&text, true);
        let part = item["content"][0].clone();
        let mut out = self.event(
            "response.output_text.done",
            json!({"content_index": 0, "item_id": id, "logprobs": [], "output_index": 0,
                "text": text}),
        );
        out += &self.event(
            "response.content_part.done",
            json!({"content_index": 0, "item_id": id, "output_index": 0, "part": part}),
        );
        out += &self.event(
            "response.output_item.done",
            json!({"item": item, "output_index": 0}),
        );
        let response = self.answer.finish(&text, ended);
        out += &self.event("response.completed", json!({"response": response}));
        self.done = true;
        out
    }
}

fn stream_answer(
    answer: Answer,
    events: mpsc::UnboundedReceiver<Event>,
    load: LoadGuard,
) -> Response {
    let state = Streaming {
        answer,
        events,
        text: String::new(),
        sequence: 0,
        opened: false,
        item_added: false,
        done: false,
        _load: load,
    };
    let body = stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        // The opening goes out at once, before the prefill, as vLLM's does.
        let out = if st.opened {
            let event = st.events.recv().await?;
            match (&event, ending(&event)) {
                (Event::Token { text }, _) => st.delta(text),
                (_, Some(ended)) => st.closing(&ended),
                _ => String::new(),
            }
        } else {
            st.opened = true;
            st.opening()
        };
        Some((Ok::<_, std::io::Error>(Bytes::from(out)), st))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
