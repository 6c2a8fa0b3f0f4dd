//! Routing key: a request body → the prompt's canonical bytes → a chain of xxh3 block hashes.
//!
//! The canonical bytes are the prompt as a worker's prefix cache sees it, in order:
//! - `prompt` as a string: its UTF-8 bytes; a list of strings: joined by 0x1E;
//!   token ids (or lists of them): each id as 4 little-endian bytes;
//! - `messages`: for each message `role 0x1F content 0x1E`, where a list of content parts
//!   contributes each text part's text and each other part's JSON with sorted keys;
//! - the Responses API's `instructions` and `input`: as the messages a worker renders from them
//!   (the instructions as a system message, a string input as a user message, each message item
//!   as its role and content), and any other item (a function call, its output, reasoning) as
//!   `type 0x1F JSON 0x1E` with sorted keys.
//!
//! Field order in the JSON and whitespace never change the bytes, so the same conversation prefix
//! always gives the same leading hashes. Only `block_bytes × max_blocks` bytes are ever produced,
//! so the cost is bounded whatever the prompt's size. Blocks are `block_bytes` long and also end
//! at every message's end, so a conversation's earlier request ends on a block boundary of its
//! later ones and its whole prompt, last partial block included, is a prefix match. Block `i`'s
//! hash is xxh3 of the block seeded with block `i-1`'s hash (block 0 is seeded with the model's
//! hash), so it covers everything before it.

use std::borrow::Cow;

use serde::Deserialize;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::{config::RoutingKeyConfig, error::ApiError};

/// What the router needs to know of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestInfo {
    pub model: Option<String>,
    /// Chained hashes of the leading blocks; the last may cover a partial block.
    pub block_hashes: Vec<u64>,
    /// For each block, the canonical byte offset where it ends (same length as `block_hashes`).
    pub block_ends: Vec<u32>,
    /// Length of the whole canonical prompt in bytes, including what was past the hashing cap
    /// (of a chat, past the cap only its messages' text: other parts are not written out to be
    /// counted).
    pub prompt_bytes: u64,
    /// The prompt's token ids as the worker will see them, when a tokenizer is configured for
    /// the model (exact routing on the workers' KV cache events): the whole prompt's, or only
    /// its head when no worker can hold anything past it (see [`crate::tokenize`]).
    pub tokens: Option<std::sync::Arc<[u32]>>,
    /// Prompt tokens after `tokens`, estimated: 0 when `tokens` is the whole prompt.
    pub tokens_after: u32,
    /// Where the chain of `tokens`' blocks starts: [`crate::kv_events::ROOT`], or for a request
    /// with a `cache_salt`, [`crate::kv_events::salted_root`] of it (vLLM hashes the salt into
    /// the first block, so a salted prompt shares blocks with the same salt only); moved on to
    /// its adapter's root when tokenized for an adapter the events have shown
    /// ([`crate::kv_events::request_root`]).
    pub token_root: u64,
}

impl RequestInfo {
    /// A request with no prompt to key on (e.g. a passthrough path).
    pub fn unkeyed() -> Self {
        Self::keyed(Vec::new(), 1)
    }

    /// A request whose blocks are `hashes`, each `block_bytes` long (tests and benchmarks).
    pub fn keyed(hashes: Vec<u64>, block_bytes: u32) -> Self {
        let n = hashes.len() as u32;
        Self {
            model: None,
            block_ends: (1..=n).map(|i| i * block_bytes).collect(),
            prompt_bytes: u64::from(n * block_bytes),
            block_hashes: hashes,
            tokens: None,
            tokens_after: 0,
            token_root: crate::kv_events::ROOT,
        }
    }

    /// Canonical bytes covered by the first `blocks` blocks.
    pub fn bytes_at_depth(&self, blocks: usize) -> u64 {
        blocks
            .checked_sub(1)
            .and_then(|i| self.block_ends.get(i))
            .map_or(0, |&e| u64::from(e))
    }

    /// The hash that covers the first `blocks` blocks (or the whole key if it is shorter).
    pub fn key_at_depth(&self, blocks: usize) -> Option<u64> {
        let n = blocks.min(self.block_hashes.len());
        n.checked_sub(1).map(|i| self.block_hashes[i])
    }
}

/// Which body field carries the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptField {
    Prompt,
    Messages,
    /// The Responses API's `instructions` and `input`.
    Input,
}

#[derive(Deserialize)]
struct RequestView<'a> {
    #[serde(default, borrow)]
    model: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    prompt: Option<PromptView<'a>>,
    #[serde(default, borrow)]
    messages: Option<Vec<MessageView<'a>>>,
    #[serde(default, borrow)]
    cache_salt: Option<Cow<'a, str>>,
}

/// A Responses API request (`POST /v1/responses`), as far as routing reads it.
#[derive(Deserialize)]
struct ResponsesView<'a> {
    #[serde(default, borrow)]
    model: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    instructions: Option<Cow<'a, str>>,
    #[serde(default)]
    input: Option<serde_json::Value>,
    #[serde(default, borrow)]
    cache_salt: Option<Cow<'a, str>>,
}

/// `prompt` as the worker accepts it: a string, a list of strings, a list of token ids, or a
/// list of lists of token ids (batches are flattened: their concatenation is what is hashed).
/// Read in one pass with no intermediate tree (an untagged enum would buffer the whole value
/// first, which made an 8 MiB `[[1],[1],…]` cost about a second): strings stay borrowed from the
/// body, and token ids past [`KEPT_TOKENS`] are checked but not kept.
enum PromptView<'a> {
    Text(Cow<'a, str>),
    Texts(Vec<Cow<'a, str>>),
    Tokens(Vec<u32>),
}

/// Token ids kept from a prompt: more than any routing key reads (`block_bytes × max_blocks`
/// is 64 KiB, 16k ids, by default).
const KEPT_TOKENS: usize = 1 << 18;

impl<'de: 'a, 'a> Deserialize<'de> for PromptView<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor(std::marker::PhantomData))
    }
}

struct PromptVisitor<'a>(std::marker::PhantomData<&'a ()>);

const PROMPT_EXPECTED: &str = "a string, a list of strings, or token ids";

impl<'de: 'a, 'a> serde::de::Visitor<'de> for PromptVisitor<'a> {
    type Value = PromptView<'a>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(PROMPT_EXPECTED)
    }

    fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(PromptView::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(PromptView::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = PromptItems::default();
        while seq.next_element_seed(&mut items)?.is_some() {}
        Ok(match items.texts {
            Some(texts) => PromptView::Texts(texts),
            None => PromptView::Tokens(items.tokens),
        })
    }
}

/// The elements of a `prompt` list, all strings or all token ids (or lists of them).
#[derive(Default)]
struct PromptItems<'a> {
    texts: Option<Vec<Cow<'a, str>>>,
    tokens: Vec<u32>,
    ids_seen: bool,
}

impl PromptItems<'_> {
    fn id<E: serde::de::Error>(&mut self, v: u64) -> Result<(), E> {
        let id = u32::try_from(v).map_err(|_| E::custom("token id out of range"))?;
        if self.texts.is_some() {
            return Err(E::custom(PROMPT_EXPECTED));
        }
        self.ids_seen = true;
        if self.tokens.len() < KEPT_TOKENS {
            self.tokens.push(id);
        }
        Ok(())
    }
}

impl<'de: 'a, 'a> serde::de::DeserializeSeed<'de> for &mut PromptItems<'a> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de: 'a, 'a> serde::de::Visitor<'de> for &mut PromptItems<'a> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(PROMPT_EXPECTED)
    }

    fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<(), E> {
        self.text(Cow::Borrowed(v))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
        self.text(Cow::Owned(v.to_owned()))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<(), E> {
        self.id(v)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        // A batch: a list of token ids.
        while let Some(v) = seq.next_element::<u64>()? {
            self.id(v)?;
        }
        Ok(())
    }
}

impl<'a> PromptItems<'a> {
    fn text<E: serde::de::Error>(&mut self, t: Cow<'a, str>) -> Result<(), E> {
        if self.ids_seen {
            return Err(E::custom(PROMPT_EXPECTED));
        }
        self.texts.get_or_insert_with(Vec::new).push(t);
        Ok(())
    }
}

#[derive(Deserialize)]
struct MessageView<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(default, borrow)]
    content: Option<ContentView<'a>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ContentView<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Parts(Vec<serde_json::Value>),
}

/// Appends bytes until the cap, then only counts them; remembers where messages end.
struct Capped {
    buf: Vec<u8>,
    cap: usize,
    /// Offsets in `buf` where a message ended.
    cuts: Vec<usize>,
    /// Every byte pushed, kept or not.
    total: u64,
}

impl Capped {
    fn new(cap: usize, hint: usize) -> Self {
        Self {
            buf: Vec::with_capacity(cap.min(hint)),
            cap,
            cuts: Vec::new(),
            total: 0,
        }
    }

    fn full(&self) -> bool {
        self.buf.len() >= self.cap
    }

    fn push(&mut self, bytes: &[u8]) -> bool {
        self.total += bytes.len() as u64;
        let room = self.cap - self.buf.len();
        self.buf.extend_from_slice(&bytes[..bytes.len().min(room)]);
        self.buf.len() < self.cap
    }

    fn cut(&mut self) {
        if self.cuts.last() != Some(&self.buf.len()) {
            self.cuts.push(self.buf.len());
        }
    }
}

/// Parses a completions, chat or Responses body and computes its routing key.
pub fn extract(
    body: &[u8],
    field: PromptField,
    cfg: &RoutingKeyConfig,
) -> Result<RequestInfo, ApiError> {
    let cap = cfg.block_bytes.saturating_mul(cfg.max_blocks);
    let mut out = Capped::new(cap, body.len() + 64);
    let (model, salt) = match field {
        PromptField::Prompt | PromptField::Messages => {
            let view: RequestView = parse(body)?;
            if field == PromptField::Prompt {
                let prompt = view
                    .prompt
                    .ok_or_else(|| ApiError::InvalidRequest("`prompt` is required".into()))?;
                write_prompt(&prompt, &mut out);
            } else {
                let messages = view
                    .messages
                    .ok_or_else(|| ApiError::InvalidRequest("`messages` is required".into()))?;
                if messages.is_empty() {
                    return Err(ApiError::InvalidRequest(
                        "`messages` must not be empty".into(),
                    ));
                }
                write_messages(&messages, &mut out);
            }
            (view.model, view.cache_salt)
        }
        PromptField::Input => {
            let view: ResponsesView = parse(body)?;
            let input = view
                .input
                .ok_or_else(|| ApiError::InvalidRequest("`input` is required".into()))?;
            write_messages(&input_messages(view.instructions, input)?, &mut out);
            (view.model, view.cache_salt)
        }
    };
    let model = model.map(Cow::into_owned);
    // A salt keys the first block as vLLM's hash does: its prefix is cached for that salt only.
    let salt = salt.filter(|s| !s.is_empty());
    let mut seed = xxh3_64(model.as_deref().unwrap_or("").as_bytes());
    if let Some(s) = &salt {
        seed = xxh3_64_with_seed(s.as_bytes(), seed);
    }
    let (block_hashes, block_ends) =
        chain_blocks(&out.buf, &out.cuts, cfg.block_bytes, cfg.max_blocks, seed);
    Ok(RequestInfo {
        model,
        block_hashes,
        block_ends,
        prompt_bytes: out.total,
        tokens: None,
        tokens_after: 0,
        token_root: salt.map_or(crate::kv_events::ROOT, |s| {
            crate::kv_events::salted_root(s.as_bytes())
        }),
    })
}

/// The body as `T`: a 400 for JSON of the wrong shape, an invalid-JSON 400 otherwise.
fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        if e.is_data() {
            ApiError::InvalidRequest(format!("invalid request: {e}"))
        } else {
            ApiError::InvalidJson(e.to_string())
        }
    })
}

fn write_prompt(prompt: &PromptView, out: &mut Capped) {
    match prompt {
        PromptView::Text(t) => {
            out.push(t.as_bytes());
        }
        PromptView::Texts(ts) => {
            for t in ts {
                if !(out.push(t.as_bytes()) && out.push(b"\x1e")) {
                    break;
                }
            }
        }
        PromptView::Tokens(ids) => write_tokens(ids, out),
    }
}

fn write_tokens(ids: &[u32], out: &mut Capped) {
    for id in ids {
        if !out.push(&id.to_le_bytes()) {
            return;
        }
    }
}

/// Writes the messages, cut after each. Past the cap, text is only counted and other parts are
/// skipped.
fn write_messages(messages: &[MessageView], out: &mut Capped) {
    for m in messages {
        out.push(m.role.as_bytes());
        out.push(b"\x1f");
        match &m.content {
            None => {}
            Some(ContentView::Text(t)) => {
                out.push(t.as_bytes());
            }
            Some(ContentView::Parts(parts)) => {
                for p in parts {
                    match part_text(p) {
                        Some(text) => {
                            out.push(text.as_bytes());
                        }
                        _ if out.full() => {}
                        _ => {
                            let mut canonical = Vec::new();
                            write_sorted(p, &mut canonical);
                            out.push(&canonical);
                        }
                    }
                }
            }
        }
        out.push(b"\x1e");
        out.cut();
    }
}

/// The text of a content part that is text: chat's `text`, the Responses API's `input_text` and
/// `output_text`.
pub(crate) fn part_text(part: &serde_json::Value) -> Option<&str> {
    let kind = part.get("type")?.as_str()?;
    if matches!(kind, "text" | "input_text" | "output_text") {
        part.get("text")?.as_str()
    } else {
        None
    }
}

/// A Responses API request's `instructions` and `input` as the messages a worker renders from
/// them: the instructions first as a system message, a string input as one user message, a list's
/// items in order (a message item as its role and content; any other item under its `type`, its
/// whole JSON as the content).
fn input_messages<'a>(
    instructions: Option<Cow<'a, str>>,
    input: serde_json::Value,
) -> Result<Vec<MessageView<'a>>, ApiError> {
    use serde_json::Value;
    let mut messages = Vec::new();
    if let Some(text) = instructions {
        messages.push(MessageView {
            role: Cow::Borrowed("system"),
            content: Some(ContentView::Text(text)),
        });
    }
    match input {
        Value::String(text) => messages.push(MessageView {
            role: Cow::Borrowed("user"),
            content: Some(ContentView::Text(Cow::Owned(text))),
        }),
        Value::Array(items) => {
            for item in items {
                let Value::Object(mut fields) = item else {
                    return Err(ApiError::InvalidRequest(
                        "`input` items must be objects".into(),
                    ));
                };
                let message = match fields.remove("role") {
                    Some(Value::String(role)) => MessageView {
                        role: Cow::Owned(role),
                        content: match fields.remove("content") {
                            Some(Value::String(text)) => Some(ContentView::Text(Cow::Owned(text))),
                            Some(Value::Array(parts)) => Some(ContentView::Parts(parts)),
                            _ => None,
                        },
                    },
                    Some(_) => {
                        return Err(ApiError::InvalidRequest(
                            "an `input` item's `role` must be a string".into(),
                        ))
                    }
                    None => {
                        let kind = match fields.get("type") {
                            Some(Value::String(kind)) => kind.clone(),
                            _ => String::from("item"),
                        };
                        MessageView {
                            role: Cow::Owned(kind),
                            content: Some(ContentView::Parts(vec![Value::Object(fields)])),
                        }
                    }
                };
                messages.push(message);
            }
        }
        _ => {
            return Err(ApiError::InvalidRequest(
                "`input` must be a string or a list of items".into(),
            ))
        }
    }
    if messages.is_empty() {
        return Err(ApiError::InvalidRequest("`input` must not be empty".into()));
    }
    Ok(messages)
}

/// `v` as JSON with every object's keys sorted, so the client's key order does not change the key.
fn write_sorted(v: &serde_json::Value, out: &mut Vec<u8>) {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(Value::String(k.clone()).to_string().as_bytes());
                out.push(b':');
                write_sorted(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_sorted(item, out);
            }
            out.push(b']');
        }
        scalar => out.extend_from_slice(scalar.to_string().as_bytes()),
    }
}

/// Chained block hashes: `h[i] = xxh3(block[i], seed = h[i-1])`, `h[-1] = seed`.
pub fn chain_hashes(bytes: &[u8], block_bytes: usize, seed: u64) -> Vec<u64> {
    chain_blocks(bytes, &[], block_bytes, usize::MAX, seed).0
}

/// Cuts `bytes` into at most `max_blocks` blocks of `block_bytes` that also end at each offset in
/// `cuts` (ascending; many tiny messages cannot make more blocks), and returns each block's
/// chained hash and end offset.
fn chain_blocks(
    bytes: &[u8],
    cuts: &[usize],
    block_bytes: usize,
    max_blocks: usize,
    seed: u64,
) -> (Vec<u64>, Vec<u32>) {
    let n = (bytes.len() / block_bytes + cuts.len() + 1).min(max_blocks);
    let (mut hashes, mut ends) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut prev = seed;
    let mut start = 0;
    let mut cuts = cuts
        .iter()
        .copied()
        .filter(|&c| c <= bytes.len())
        .peekable();
    while start < bytes.len() && hashes.len() < max_blocks {
        let mut end = (start + block_bytes).min(bytes.len());
        while let Some(&c) = cuts.peek() {
            if c > start {
                end = end.min(c);
                break;
            }
            cuts.next();
        }
        prev = xxh3_64_with_seed(&bytes[start..end], prev);
        hashes.push(prev);
        ends.push(end as u32);
        start = end;
    }
    (hashes, ends)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg(block: usize, max: usize) -> RoutingKeyConfig {
        RoutingKeyConfig {
            block_bytes: block,
            max_blocks: max,
        }
    }

    fn chat_key(body: serde_json::Value) -> RequestInfo {
        extract(
            body.to_string().as_bytes(),
            PromptField::Messages,
            &cfg(8, 64),
        )
        .unwrap()
    }

    fn input_key(body: serde_json::Value) -> RequestInfo {
        extract(body.to_string().as_bytes(), PromptField::Input, &cfg(8, 64)).unwrap()
    }

    #[test]
    fn a_responses_request_keys_as_the_chat_it_renders_to() {
        // Instructions are the system message, a string input the user's: the same blocks as
        // the chat completion a worker renders them to.
        let responses = input_key(serde_json::json!({
            "model": "m", "instructions": "You are terse.", "input": "What is KV?"
        }));
        let chat = chat_key(serde_json::json!({"model": "m", "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is KV?"}
        ]}));
        assert_eq!(responses, chat);
        // Parts of type input_text and output_text count as text, as chat's text parts do.
        let parts = input_key(
            serde_json::json!({"model": "m", "instructions": "You are terse.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is KV?"}]}]}),
        );
        assert_eq!(parts.block_hashes, chat.block_hashes);
    }

    #[test]
    fn a_responses_conversations_next_turn_extends_its_key() {
        let turn1 = serde_json::json!([{"role": "user", "content": "Plan a trip to Lyon."}]);
        let mut turn2 = turn1.as_array().unwrap().clone();
        // The server's output items, sent back as they came (ids, status and all), then the
        // next question.
        turn2.push(serde_json::json!({"type": "message", "id": "msg_1", "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Day one: the old town.", "annotations": []}]}));
        turn2.push(serde_json::json!({"type": "function_call", "call_id": "c1",
            "name": "weather", "arguments": "{\"city\":\"Lyon\"}"}));
        turn2.push(
            serde_json::json!({"type": "function_call_output", "call_id": "c1",
            "output": "sunny"}),
        );
        turn2.push(serde_json::json!({"role": "user", "content": "And day two?"}));
        let a = input_key(
            serde_json::json!({"model": "m", "instructions": "Be brief.", "input": turn1}),
        );
        let b = input_key(
            serde_json::json!({"model": "m", "instructions": "Be brief.", "input": turn2}),
        );
        assert!(b.block_hashes.len() > a.block_hashes.len());
        assert_eq!(b.block_hashes[..a.block_hashes.len()], a.block_hashes[..]);
        // A tool item's field order does not change its blocks.
        let reordered = serde_json::json!([{"role": "user", "content": "Plan a trip to Lyon."},
            {"output": "sunny", "call_id": "c1", "type": "function_call_output"}]);
        let original = serde_json::json!([{"role": "user", "content": "Plan a trip to Lyon."},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]);
        assert_eq!(
            input_key(serde_json::json!({"input": reordered})),
            input_key(serde_json::json!({"input": original}))
        );
    }

    #[test]
    fn a_responses_request_without_usable_input_is_refused() {
        let c = cfg(8, 64);
        for body in [
            &br#"{"model":"m"}"#[..],
            br#"{"input":[]}"#,
            br#"{"input":5}"#,
            br#"{"input":["text"]}"#,
            br#"{"input":[{"role":7,"content":"x"}]}"#,
            br#"{"input":"x","instructions":{"a":1}}"#,
        ] {
            let e = extract(body, PromptField::Input, &c).unwrap_err();
            assert!(
                matches!(e, ApiError::InvalidRequest(_)),
                "{}: {e:?}",
                String::from_utf8_lossy(body)
            );
        }
        // Instructions alone, with an empty list, are a prompt.
        assert!(extract(
            br#"{"instructions":"x","input":[]}"#,
            PromptField::Input,
            &c
        )
        .is_ok());
        // A chat body's own fields are not read as a Responses request's, nor the reverse.
        assert!(extract(
            br#"{"messages":[{"role":"user","content":"x"}],"instructions":5}"#,
            PromptField::Messages,
            &c
        )
        .is_ok());
    }

    /// vLLM hashes `cache_salt` into a prompt's first block: another salt, or none, shares no
    /// cached block with it, so neither may share a key.
    #[test]
    fn a_cache_salt_keys_the_prompt_apart_from_other_salts() {
        let key = |body: serde_json::Value, field| {
            extract(body.to_string().as_bytes(), field, &cfg(16, 8)).unwrap()
        };
        let prompt = "a prompt long enough to fill more than one block";
        let completion = |salt: Option<&str>| {
            let mut b = serde_json::json!({"model": "m", "prompt": prompt});
            if let Some(s) = salt {
                b["cache_salt"] = s.into();
            }
            key(b, PromptField::Prompt)
        };
        let (plain, a, a2, b) = (
            completion(None),
            completion(Some("tenant-a")),
            completion(Some("tenant-a")),
            completion(Some("tenant-b")),
        );
        assert_eq!(plain.token_root, crate::kv_events::ROOT);
        assert_eq!(a.token_root, crate::kv_events::salted_root(b"tenant-a"));
        assert_eq!(
            (&a.block_hashes, a.token_root),
            (&a2.block_hashes, a2.token_root)
        );
        for other in [&plain, &b] {
            assert_ne!(a.block_hashes[0], other.block_hashes[0]);
            assert_ne!(a.token_root, other.token_root);
        }
        assert_eq!(
            completion(Some("")).block_hashes,
            plain.block_hashes,
            "empty: none"
        );
        let chat = key(
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": prompt}],
                               "cache_salt": "tenant-a"}),
            PromptField::Messages,
        );
        assert_eq!(chat.token_root, a.token_root);
        let input = key(
            serde_json::json!({"model": "m", "input": prompt, "cache_salt": "tenant-a"}),
            PromptField::Input,
        );
        assert_eq!(input.token_root, a.token_root);
    }

    #[test]
    fn field_order_and_whitespace_do_not_change_the_key() {
        let a = br#"{"model":"m","prompt":"hello world, this is long"}"#;
        let b =
            b"{ \"prompt\" : \"hello world, this is long\",\n \"model\": \"m\", \"max_tokens\": 5}";
        let c = cfg(8, 64);
        assert_eq!(
            extract(a, PromptField::Prompt, &c).unwrap(),
            extract(b, PromptField::Prompt, &c).unwrap()
        );
    }

    #[test]
    fn string_content_equals_single_text_part() {
        let a =
            chat_key(serde_json::json!({"messages":[{"role":"user","content":"same words here"}]}));
        let b = chat_key(
            serde_json::json!({"messages":[{"role":"user","content":[{"type":"text","text":"same words here"}]}]}),
        );
        assert_eq!(a, b);
    }

    #[test]
    fn a_longer_conversation_keeps_the_earlier_turns_hashes() {
        let turn1 = serde_json::json!({"messages":[
            {"role":"system","content":"You are a careful assistant."},
            {"role":"user","content":"What is a KV cache?"}]});
        let mut turn2 = turn1.clone();
        turn2["messages"].as_array_mut().unwrap().extend([
            serde_json::json!({"role":"assistant","content":"It stores keys."}),
            serde_json::json!({"role":"user","content":"And values?"}),
        ]);
        let (a, b) = (chat_key(turn1), chat_key(turn2));
        let n = a.block_hashes.len();
        assert!(n >= 5);
        // Blocks end at message ends, so all of turn 1, its last short block too, is a prefix of turn 2.
        assert_eq!(a.block_hashes[..], b.block_hashes[..n]);
        assert_eq!(a.block_ends[..], b.block_ends[..n]);
        assert!(b.block_hashes.len() > n);
        assert_eq!(a.prompt_bytes, u64::from(a.block_ends[n - 1]));
    }

    #[test]
    fn blocks_end_at_block_size_and_at_every_message_end() {
        // "system\x1f" + 12 bytes + "\x1e" = 20 bytes, then "user\x1f" + 3 + "\x1e" = 9 bytes.
        let k = chat_key(serde_json::json!({"messages":[
            {"role":"system","content":"abcdefghijkl"},
            {"role":"user","content":"xyz"}]}));
        assert_eq!(k.block_ends, [8, 16, 20, 28, 29]);
        assert_eq!(k.block_hashes.len(), 5);
        assert_eq!(k.bytes_at_depth(3), 20);
        assert_eq!(k.bytes_at_depth(0), 0);
    }

    /// A chat longer than the hashing cap is as long as its messages, not as the cap: its length
    /// prices its prefill and teaches bytes per token from the worker's token count.
    #[test]
    fn a_chats_length_counts_text_past_the_hashing_cap() {
        let body = serde_json::json!({"messages":[
            {"role":"system","content":"x".repeat(100)},
            {"role":"user","content":[{"type":"text","text":"y".repeat(50)}]},
            {"role":"user","content":"z".repeat(30)}]})
        .to_string();
        let k = extract(body.as_bytes(), PromptField::Messages, &cfg(8, 2)).unwrap();
        assert_eq!(k.block_ends, [8, 16]);
        // 6 + 1 + 100 + 1, 4 + 1 + 50 + 1, 4 + 1 + 30 + 1.
        assert_eq!(k.prompt_bytes, 200);
    }

    #[test]
    fn many_tiny_messages_make_no_more_than_max_blocks() {
        let messages: Vec<_> = (0..500)
            .map(|_| serde_json::json!({"role": "u", "content": "x"}))
            .collect();
        let body = serde_json::json!({ "messages": messages }).to_string();
        let k = extract(body.as_bytes(), PromptField::Messages, &cfg(256, 16)).unwrap();
        assert_eq!(k.block_hashes.len(), 16);
    }

    #[test]
    fn prompt_length_counts_bytes_past_the_hashing_cap() {
        let c = cfg(8, 2);
        let body = serde_json::json!({"prompt": "x".repeat(100)}).to_string();
        let k = extract(body.as_bytes(), PromptField::Prompt, &c).unwrap();
        assert_eq!(k.block_ends, [8, 16]);
        assert_eq!(k.prompt_bytes, 100);
    }

    #[test]
    fn key_order_inside_a_non_text_part_does_not_change_the_key() {
        let a = chat_key(serde_json::json!({"messages":[{"role":"user","content":[
            {"type":"image_url","image_url":{"url":"http://x/a.png","detail":"low"}}]}]}));
        let b: serde_json::Value = serde_json::from_str(
            r#"{"messages":[{"role":"user","content":[{"image_url":{"detail":"low","url":"http://x/a.png"},"type":"image_url"}]}]}"#,
        )
        .unwrap();
        assert_eq!(a.block_hashes, chat_key(b).block_hashes);
    }

    #[test]
    fn model_seeds_the_chain() {
        let c = cfg(8, 4);
        let a = extract(br#"{"model":"a","prompt":"xyz"}"#, PromptField::Prompt, &c).unwrap();
        let b = extract(br#"{"model":"b","prompt":"xyz"}"#, PromptField::Prompt, &c).unwrap();
        assert_ne!(a.block_hashes, b.block_hashes);
        assert_eq!(a.model.as_deref(), Some("a"));
    }

    #[test]
    fn token_prompts_are_keyed() {
        let c = cfg(16, 4);
        let a = extract(
            br#"{"prompt":[1,2,3,4,5,6,7,8,9]}"#,
            PromptField::Prompt,
            &c,
        )
        .unwrap();
        let b = extract(
            br#"{"prompt":[[1,2,3,4,5,6,7,8,9]]}"#,
            PromptField::Prompt,
            &c,
        )
        .unwrap();
        assert_eq!(a.block_hashes.len(), 3); // 36 bytes in 16-byte blocks
        assert_eq!(a.block_hashes, b.block_hashes);
    }

    #[test]
    fn a_huge_token_prompt_is_keyed_from_its_start_without_keeping_it() {
        let c = cfg(16, 4);
        let mut body = String::from(r#"{"prompt":["#);
        for i in 0..(KEPT_TOKENS + 1000) {
            body.push_str(if i == 0 { "[7]" } else { ",[1]" });
        }
        body.push_str("]}");
        let k = extract(body.as_bytes(), PromptField::Prompt, &c).unwrap();
        let short = extract(
            br#"{"prompt":[7,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]}"#,
            PromptField::Prompt,
            &c,
        )
        .unwrap();
        assert_eq!(k.block_hashes, short.block_hashes);
    }

    #[test]
    fn mixed_prompt_lists_are_client_errors() {
        let c = cfg(8, 4);
        for body in [
            &br#"{"prompt":["a",1]}"#[..],
            br#"{"prompt":[1,"a"]}"#,
            br#"{"prompt":[1,[2,"x"]]}"#,
            br#"{"prompt":[-1]}"#,
            br#"{"prompt":[4294967296]}"#,
            br#"{"prompt":[1.5]}"#,
            br#"{"prompt":null}"#,
        ] {
            let e = extract(body, PromptField::Prompt, &c).unwrap_err();
            assert_eq!(
                e.status_and_type().0,
                400,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // Strings with escapes are not borrowed but still work.
        let k = extract(br#"{"prompt":["a\nb","c"]}"#, PromptField::Prompt, &c).unwrap();
        assert!(!k.block_hashes.is_empty());
    }

    #[test]
    fn bad_bodies_are_client_errors() {
        let c = cfg(8, 4);
        for (body, field) in [
            (&b"{not json"[..], PromptField::Prompt),
            (br#"{"model":"m"}"#, PromptField::Prompt),
            (br#"{"messages":[]}"#, PromptField::Messages),
            (br#"{"prompt":{"a":1}}"#, PromptField::Prompt),
            (br#"[1,2]"#, PromptField::Prompt),
        ] {
            let e = extract(body, field, &c).unwrap_err();
            assert_eq!(e.status_and_type().0, 400, "{e}");
        }
    }

    proptest! {
        #[test]
        fn only_the_first_bytes_are_hashed(prefix in "[a-z ]{40,60}", tail_a in "[a-z]{0,50}", tail_b in "[a-z]{0,50}") {
            let c = cfg(8, 4); // 32 bytes are hashed
            let body = |t: &str| serde_json::json!({"prompt": format!("{prefix}{t}")}).to_string();
            let a = extract(body(&tail_a).as_bytes(), PromptField::Prompt, &c).unwrap();
            let b = extract(body(&tail_b).as_bytes(), PromptField::Prompt, &c).unwrap();
            prop_assert_eq!(a.block_hashes.len(), 4);
            prop_assert_eq!(a.block_hashes, b.block_hashes);
            prop_assert_eq!(a.block_ends, b.block_ends);
        }

        #[test]
        fn shared_leading_blocks_share_hashes(common in proptest::collection::vec(any::<u8>(), 0..100), a in proptest::collection::vec(any::<u8>(), 1..50), b in proptest::collection::vec(any::<u8>(), 1..50)) {
            let join = |t: &[u8]| [common.as_slice(), t].concat();
            let (ha, hb) = (chain_hashes(&join(&a), 16, 7), chain_hashes(&join(&b), 16, 7));
            let full = common.len() / 16;
            prop_assert_eq!(&ha[..full], &hb[..full]);
        }
    }
}
