//! The Responses API's state in a pool: which worker holds a stored response.
//!
//! vLLM keeps a response it stored (`store: true`, with `VLLM_ENABLE_RESPONSES_API_STORE=1`) in
//! the memory of the process that made it. A request that continues it (`previous_response_id`)
//! or asks for it (`GET`, `DELETE`, `cancel` on `/v1/responses/{id}`) is answered only there:
//! any other worker says 404. So the gateway remembers, for each response it relayed, the worker
//! that made it ([`Homes`], bounded: the oldest are forgotten first), and sends those requests
//! there. An id it does not know (another replica relayed it, this one restarted or forgot it)
//! is looked for on every worker at once with a `GET /v1/responses/{id}`, and the one that has
//! it is remembered. Where no worker has it, the request goes to the least-loaded worker, and
//! its own 404 is the answer.
//!
//! A continued conversation's earlier turns are cached on the worker that holds them, too, so
//! following the response is also what prefix-aware routing would choose.

use std::{collections::VecDeque, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::{stream::FuturesUnordered, StreamExt};
use http_body_util::Full;
use memchr::memmem;
use parking_lot::Mutex;
use serde_json::Value;

use crate::{proxy::Upstreams, workers::Worker};

/// Response ids remembered at most: about 150 bytes each, 15 MB in all.
pub const REMEMBERED: usize = 100_000;

/// How long a lookup waits for the workers' answers.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// Stored responses' workers, by response id; the oldest forgotten first past the cap.
pub struct Homes {
    inner: Mutex<Inner>,
    cap: usize,
}

#[derive(Default)]
struct Inner {
    by_id: std::collections::HashMap<Box<str>, Arc<str>>,
    /// Ids in the order they were first remembered.
    order: VecDeque<Box<str>>,
}

impl Homes {
    pub fn new(cap: usize) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            cap: cap.max(1),
        }
    }

    /// Remembers that worker `worker` holds response `id`.
    pub fn remember(&self, id: &str, worker: &Arc<str>) {
        let mut inner = self.inner.lock();
        if let Some(home) = inner.by_id.get_mut(id) {
            *home = Arc::clone(worker);
            return;
        }
        while inner.order.len() >= self.cap {
            if let Some(old) = inner.order.pop_front() {
                inner.by_id.remove(&old);
            }
        }
        inner.by_id.insert(id.into(), Arc::clone(worker));
        inner.order.push_back(id.into());
    }

    /// The worker remembered for `id`.
    pub fn home(&self, id: &str) -> Option<Arc<str>> {
        self.inner.lock().by_id.get(id).cloned()
    }

    /// How many ids are remembered.
    pub fn len(&self) -> usize {
        self.inner.lock().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The id of the response in the first bytes of a Responses answer: a JSON response's own `id`
/// (its first field), or the one in a stream's `response.created` event. `None` when the bytes
/// hold no whole id.
pub fn response_id_in(data: &[u8]) -> Option<&str> {
    static ID: std::sync::LazyLock<memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memmem::Finder::new(b"\"id\""));
    let at = ID.find(data)? + 4;
    let rest = data[at..].trim_ascii_start().strip_prefix(b":")?;
    let rest = rest.trim_ascii_start().strip_prefix(b"\"")?;
    let end = rest.iter().position(|&b| b == b'"')?;
    let id = &rest[..end];
    let plain = !id.is_empty()
        && id.len() <= 256
        && id
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    plain.then(|| std::str::from_utf8(id).ok()).flatten()
}

/// The `previous_response_id` a Responses request continues, if it names one.
pub fn previous_response_id(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Continues<'a> {
        #[serde(borrow, default)]
        previous_response_id: Option<std::borrow::Cow<'a, str>>,
    }
    let c: Continues = serde_json::from_slice(body).ok()?;
    c.previous_response_id
        .map(std::borrow::Cow::into_owned)
        .filter(|id| !id.is_empty())
}

/// The response id a `/v1/responses/{id}[/...]` path names.
pub fn id_in_path(path: &str) -> Option<&str> {
    let id = path.strip_prefix("/v1/responses/")?.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// The worker among `workers` that holds response `id`, asked of all of them at once: the first
/// to answer `GET /v1/responses/{id}` with a success. `None` when none does in time.
pub async fn locate(up: &Upstreams, workers: &[Arc<Worker>], id: &str) -> Option<Arc<str>> {
    let mut asks: FuturesUnordered<_> = workers
        .iter()
        .filter(|w| w.is_usable())
        .map(|w| async move {
            let uri = format!("{}://{}/v1/responses/{id}", w.scheme, w.authority);
            let mut req = http::Request::get(uri);
            if let Some(key) = &up.auth.worker_authorization {
                req = req.header(http::header::AUTHORIZATION, key.clone());
            }
            let req = req.body(Full::new(Bytes::new())).ok()?;
            let resp = tokio::time::timeout(LOOKUP_TIMEOUT, up.client.request(req))
                .await
                .ok()?
                .ok()?;
            resp.status()
                .is_success()
                .then(|| Arc::<str>::from(w.name.as_str()))
        })
        .collect();
    while let Some(found) = asks.next().await {
        if found.is_some() {
            return found;
        }
    }
    None
}

/// A Responses request's `instructions` and `input` as chat messages, for the model's chat
/// template, as vLLM builds them (0.32: `construct_input_messages`): `None` when an item has no
/// plain chat form (a tool call, reasoning, a part that is not text), and the request is then
/// routed without token ids.
pub fn chat_messages(instructions: Option<&Value>, input: &Value) -> Option<Value> {
    let mut messages = Vec::new();
    match instructions {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => {
            messages.push(serde_json::json!({"role": "system", "content": text}));
        }
        Some(_) => return None,
    }
    match input {
        Value::String(text) => messages.push(serde_json::json!({"role": "user", "content": text})),
        Value::Array(items) => {
            for item in items {
                let role = item.get("role")?.as_str()?;
                let content = match item.get("content")? {
                    Value::String(text) => Value::String(text.clone()),
                    // vLLM keeps an assistant message's first part alone, as a string.
                    Value::Array(parts) if role == "assistant" => {
                        Value::String(crate::routing_key::part_text(parts.first()?)?.to_owned())
                    }
                    Value::Array(parts) => Value::Array(
                        parts
                            .iter()
                            .map(|p| {
                                let text = crate::routing_key::part_text(p)?;
                                Some(serde_json::json!({"type": "text", "text": text}))
                            })
                            .collect::<Option<_>>()?,
                    ),
                    _ => return None,
                };
                messages.push(serde_json::json!({"role": role, "content": content}));
            }
        }
        _ => return None,
    }
    Some(Value::Array(messages))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_ids_are_forgotten_past_the_cap() {
        let homes = Homes::new(3);
        let (a, b): (Arc<str>, Arc<str>) = ("w0".into(), "w1".into());
        for i in 0..5 {
            homes.remember(&format!("resp_{i}"), if i % 2 == 0 { &a } else { &b });
        }
        assert_eq!(homes.len(), 3);
        assert_eq!(homes.home("resp_0"), None);
        assert_eq!(homes.home("resp_1"), None);
        assert_eq!(homes.home("resp_2").as_deref(), Some("w0"));
        assert_eq!(homes.home("resp_4").as_deref(), Some("w0"));
        // Remembered again elsewhere (found on another worker): moved, not counted twice.
        homes.remember("resp_4", &b);
        assert_eq!(homes.home("resp_4").as_deref(), Some("w1"));
        assert_eq!(homes.len(), 3);
    }

    #[test]
    fn the_response_id_is_found_in_a_json_answer_and_in_the_created_event() {
        let json = br#"{"id":"resp_a1b2","created_at":1,"output":[{"id":"msg_9"}]}"#;
        assert_eq!(response_id_in(json), Some("resp_a1b2"));
        let event = b"event: response.created\ndata: {\"response\": {\"id\" : \"resp_77-x\", \"output\": []}, \"sequence_number\": 0, \"type\": \"response.created\"}\n\n";
        assert_eq!(response_id_in(event), Some("resp_77-x"));
        // Cut short, or not an id: nothing.
        assert_eq!(response_id_in(br#"{"id":"resp_a1"#), None);
        assert_eq!(response_id_in(br#"{"id":17}"#), None);
        assert_eq!(response_id_in(br#"{"id":"a b"}"#), None);
        assert_eq!(response_id_in(b"data: {\"object\":\"x\"}"), None);
    }

    #[test]
    fn the_continued_response_is_read_from_the_body_and_the_stored_one_from_the_path() {
        assert_eq!(
            previous_response_id(br#"{"input":"x","previous_response_id":"resp_1"}"#).as_deref(),
            Some("resp_1")
        );
        assert_eq!(previous_response_id(br#"{"input":"x"}"#), None);
        assert_eq!(
            previous_response_id(br#"{"previous_response_id":""}"#),
            None
        );
        assert_eq!(previous_response_id(b"not json"), None);
        assert_eq!(id_in_path("/v1/responses/resp_1"), Some("resp_1"));
        assert_eq!(id_in_path("/v1/responses/resp_1/cancel"), Some("resp_1"));
        assert_eq!(id_in_path("/v1/responses/"), None);
        assert_eq!(id_in_path("/v1/responses"), None);
    }

    #[test]
    fn input_items_become_chat_messages_only_where_they_have_a_chat_form() {
        let input = serde_json::json!([
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "message", "role": "assistant", "id": "m1",
             "content": [{"type": "output_text", "text": "hello", "annotations": []}]}
        ]);
        let instructions = Value::String("be kind".into());
        assert_eq!(
            chat_messages(Some(&instructions), &input),
            Some(serde_json::json!([
                {"role": "system", "content": "be kind"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": "hello"}
            ]))
        );
        assert_eq!(
            chat_messages(None, &Value::String("q".into())),
            Some(serde_json::json!([{"role": "user", "content": "q"}]))
        );
        let tool =
            serde_json::json!([{"type": "function_call_output", "call_id": "c", "output": "x"}]);
        assert_eq!(chat_messages(None, &tool), None);
        let image = serde_json::json!([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]);
        assert_eq!(chat_messages(None, &image), None);
    }
}
