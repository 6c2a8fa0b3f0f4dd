//! A simulated request's answer in vLLM's shapes: the engine's events turned into one JSON
//! completion, or relayed as they come as Server-Sent Events.
//!
//! The shapes follow vLLM's OpenAI server: SSE events `data: {json}\n\n` ending with
//! `data: [DONE]\n\n`; chat streams open with a `role` delta; the last content chunk carries
//! `finish_reason`; `stream_options.include_usage` adds a final chunk with empty `choices` and the
//! usage, `continuous_usage_stats` puts usage on every chunk. Usage always carries
//! `prompt_tokens_details.cached_tokens`, as vLLM does with `--enable-prompt-tokens-details`.

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::api::LoadGuard;
use super::engine::Event;
use crate::error::error_response;

/// What the simulator puts where vLLM names its version and build.
const SYSTEM_FINGERPRINT: &str = "kvroute-sim";

/// What every chunk or answer of one request repeats, and what its usage is counted from.
pub(super) struct Reply {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub chat: bool,
    pub include_usage: bool,
    pub continuous_usage: bool,
    pub prompt_tokens: usize,
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

pub(super) fn stream_response(
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

pub(super) async fn complete_response(
    reply: Reply,
    mut events: mpsc::UnboundedReceiver<Event>,
) -> Response {
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
