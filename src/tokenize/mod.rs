//! Tokenizing a request as the vLLM worker does, so its blocks can be compared with the blocks
//! the worker's KV cache events name.
//!
//! A model's `tokenizer.json` (the Hugging Face `tokenizers` format) and, for chat requests, the
//! `chat_template` of its `tokenizer_config.json` (Jinja, rendered with minijinja). vLLM's two
//! paths, reproduced: a completion's string prompt is encoded with the tokenizer's special tokens
//! (a Llama tokenizer's post-processor adds `<|begin_of_text|>`); a chat request's messages are
//! rendered through the template with `add_generation_prompt` and the result encoded without
//! special tokens (the template writes them itself).
//!
//! Encoding is the expensive part (a Llama 3 vocabulary: about 0.05 ms per KB here, 0.2-0.4 ms
//! by the `tokenizers` crate's own road; see below), and a chat request repeats its
//! predecessors: the system prompt and every earlier turn. The tokenizer splits its input at
//! added tokens (`<|start_header_id|>`, `<|eot_id|>`, ...) before anything else, so the text
//! between two of them encodes the same wherever it appears; those pieces are cached (by xxh3 of
//! their text, bounded in tokens), and a request pays only for its new ones.
//! Whether a tokenizer really behaves so is checked when it is loaded, on a rendered sample
//! conversation: if the pieces encoded apart differ from the whole, the cache is not used.
//!
//! New text need not be encoded whole before routing. The worker's blocks are a chain from the
//! prompt's start, so no worker can hold anything past the first block that none holds, and
//! routing needs only the tokens up to there: [`ModelTokenizer::head`] (`head.rs`) encodes the leading
//! bytes of the new text, cut where the tokenizer's own normalizer and pre-tokenizer split it
//! two splits before the cut (byte-pair merges never cross a split, and the last splits of a
//! cut text may differ from the whole's), and estimates the tokens after it. That this gives a
//! prefix of the whole's ids is checked when the tokenizer is loaded, at every cut of a sample
//! text; where it does not, heads are not used.
//!
//! Byte-level BPE tokenizers (Llama 3's, Qwen's, GPT-2's) are encoded past the crate's last
//! pre-tokenizing step and, where they can be, its per-piece bookkeeping, which cost more than
//! the rest of encoding (`byte_level.rs`). The ids must be the crate's: the tokenizer's shape is
//! matched strictly, sample texts are encoded both ways when it loads, and a tokenizer that
//! differs keeps the crate's road. The simulated worker always takes the crate's road, so the
//! tests that check the gateway's predictions against it check this too.

use std::{collections::HashMap, path::Path, sync::Arc};

use parking_lot::Mutex;

use xxhash_rust::xxh3::xxh3_64;

mod byte_level;
mod conversation;
mod head;
mod template;
use byte_level::ByteLevelRoad;
pub use conversation::ChatOptions;
pub use head::{Head, HEAD_BYTES};
use template::ChatTemplate;
pub use template::CHAT_TEMPLATE_FILE;

use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("cannot read {path}: {detail}")]
    Load { path: String, detail: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Encode(String),
}

/// One model's tokenizer and chat template.
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// The chat template with its `bos_token` / `eos_token`, when the model has one.
    chat: Option<ChatTemplate>,
    /// Added tokens: where encoding splits its input.
    added: AddedTokens,
    /// The characters added tokens start with (for Llama 3, only `<`).
    first: Vec<char>,
    /// Encoded pieces of chat text, when the load-time check allowed it.
    pieces: Option<PieceCache>,
    /// A text's head encodes as the start of the whole (the load-time check): see
    /// [`ModelTokenizer::head`].
    heads: bool,
    /// What the post-processor puts before a text encoded with special tokens (a BOS).
    special_prefix: Vec<u32>,
    /// The byte-level road past the crate's last pre-tokenizing step, when the tokenizer has
    /// that shape and the load-time check found it encoding as the crate does (`byte_level.rs`).
    byte_level: Option<ByteLevelRoad>,
}

/// A tokenizer's added tokens that split its input, looked up by their text at each length they
/// come in (Llama 3 has 256, in a few lengths): a lookup per length where one may start, not a
/// comparison per token.
struct AddedTokens {
    ids: HashMap<String, u32>,
    /// The lengths of the tokens, longest first (the longest match wins, as in the tokenizer).
    lens: Vec<usize>,
}

impl AddedTokens {
    /// The longest added token `text` starts with: its length and id.
    fn starting(&self, text: &str) -> Option<(usize, u32)> {
        self.lens
            .iter()
            .find_map(|&len| Some((len, *self.ids.get(text.get(..len)?)?)))
    }
}

/// Token ids of text pieces, by the xxh3 of the text; emptied whole when it holds
/// [`PIECE_CACHE_TOKENS`] tokens.
#[derive(Default)]
struct PieceCache {
    map: Mutex<Pieces>,
}

/// The cached pieces and the tokens they hold.
#[derive(Default)]
struct Pieces {
    ids: HashMap<u64, Arc<[u32]>>,
    tokens: usize,
}

/// Tokens the piece cache holds at most (about 16 MiB).
const PIECE_CACHE_TOKENS: usize = 4 << 20;

impl ModelTokenizer {
    /// Loads `tokenizer.json` and, when given, the chat template of `tokenizer_config.json` (a
    /// `chat_template.jinja` beside it first, as `transformers` reads them).
    pub fn load(tokenizer_json: &Path, config: Option<&Path>) -> Result<Self, TokenizeError> {
        Self::load_with_template(tokenizer_json, config, None)
    }

    /// [`Self::load`], the chat template read from `chat_template` instead when given (a Jinja
    /// file, as vLLM's `--chat-template` takes one).
    pub fn load_with_template(
        tokenizer_json: &Path,
        config: Option<&Path>,
        chat_template: Option<&Path>,
    ) -> Result<Self, TokenizeError> {
        let load_err = |path: &Path, detail: String| TokenizeError::Load {
            path: path.display().to_string(),
            detail,
        };
        let tokenizer = tokenizers::Tokenizer::from_file(tokenizer_json)
            .map_err(|e| load_err(tokenizer_json, e.to_string()))?;
        let v: Value = match config {
            None => Value::Null,
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).map_err(|e| load_err(path, e.to_string()))?;
                serde_json::from_str(&text).map_err(|e| load_err(path, e.to_string()))?
            }
        };
        let dir = config.and_then(Path::parent);
        let chat = ChatTemplate::find(&v, dir, chat_template)?;
        let ids: HashMap<String, u32> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| !t.lstrip && !t.rstrip && !t.single_word)
            .map(|(id, t)| (t.content, id))
            .collect();
        let mut lens: Vec<usize> = ids.keys().map(String::len).collect();
        lens.sort_unstable_by(|a, b| b.cmp(a));
        lens.dedup();
        let mut first: Vec<char> = ids.keys().filter_map(|t| t.chars().next()).collect();
        let added = AddedTokens { ids, lens };
        first.sort_unstable();
        first.dedup();
        let mut me = Self {
            tokenizer,
            chat,
            added,
            first,
            pieces: None,
            heads: false,
            special_prefix: Vec::new(),
            byte_level: None,
        };
        // What special tokens put before a text, by the crate's road: the byte-level road and
        // heads start from it, so neither is taken without it.
        let prefix = me.encode_by_the_crate("", true);
        if let Ok(prefix) = &prefix {
            me.special_prefix.clone_from(prefix);
            me.byte_level = ByteLevelRoad::of(&me.tokenizer);
            if !me.byte_level_encodes_like_the_crate() {
                me.byte_level = None;
            }
        }
        if me.pieces_encode_like_the_whole() {
            me.pieces = Some(PieceCache::default());
        }
        if prefix.is_ok() {
            me.heads = me.heads_encode_like_the_whole();
        }
        Ok(me)
    }

    /// The load-time check of the byte-level road: sample texts (added tokens, digits,
    /// contractions, runs of spaces and line ends, other scripts, emoji), with and without the
    /// special tokens, must encode to the crate's own ids.
    fn byte_level_encodes_like_the_crate(&self) -> bool {
        if self.byte_level.is_none() {
            return false;
        }
        let mut samples: Vec<String> = [
            "",
            " ",
            "a",
            "\n\n\n",
            head::CHECK_TEXT,
            "I'LL've they'RE",
            "fn main() {\n    let v = vec![1, 2, 3];\n    println!(\"{v:?}\");\n}\n",
            " \u{a0}\u{2003}zero\u{200b}width \u{feff}bom \u{7f}\u{1}\u{ad}soft",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        let mut added: Vec<&String> = self.added.ids.keys().collect();
        added.sort_unstable();
        if let Some(token) = added.first() {
            samples.push(format!("{token}Hi there{token} {token}\n{token}"));
        }
        if let Ok(chat) = self.render_chat(&check_conversation()) {
            samples.push(chat);
        }
        samples.iter().all(|text| {
            [false, true].into_iter().all(|special| {
                let ours = self.encode(text, special);
                let crates = self.encode_by_the_crate(text, special);
                matches!((ours, crates), (Ok(a), Ok(b)) if a == b)
            })
        })
    }

    /// The load-time check of the piece cache: a sample conversation, encoded whole and piece by
    /// piece, must give the same ids.
    fn pieces_encode_like_the_whole(&self) -> bool {
        if self.chat.is_none() || self.added.ids.is_empty() {
            return false;
        }
        let Ok(text) = self.render_chat(&check_conversation()) else {
            return false;
        };
        let whole = self.encode(&text, false);
        let mut apart = Vec::new();
        for piece in self.split(&text) {
            match piece {
                Piece::Added(id) => apart.push(id),
                Piece::Text(t) => match self.encode(t, false) {
                    Ok(ids) => apart.extend(ids),
                    Err(_) => return false,
                },
            }
        }
        whole.is_ok_and(|w| w == apart)
    }

    /// `text` cut at its added tokens.
    fn split<'t>(&self, text: &'t str) -> Vec<Piece<'t>> {
        let mut out = Vec::new();
        let mut rest = text;
        let mut at = 0;
        'scan: while at < rest.len() {
            let Some(off) = self.next_added_start(&rest[at..]) else {
                break;
            };
            at += off;
            if let Some((len, id)) = self.added.starting(&rest[at..]) {
                if at > 0 {
                    out.push(Piece::Text(&rest[..at]));
                }
                out.push(Piece::Added(id));
                rest = &rest[at + len..];
                at = 0;
                continue 'scan;
            }
            at += rest[at..].chars().next().map_or(1, char::len_utf8);
        }
        if !rest.is_empty() {
            out.push(Piece::Text(rest));
        }
        out
    }

    /// Where in `text` the next character that may start an added token is. Usually every added
    /// token starts with one of at most three ASCII characters (Llama 3's all start with `<`), and
    /// `memchr` finds them a word at a time instead of decoding every character, which was most
    /// of a conversation's next-turn tokenizing at 32 KB (see the README).
    fn next_added_start(&self, text: &str) -> Option<usize> {
        let b = text.as_bytes();
        match self.first.as_slice() {
            [] => None,
            [a] if a.is_ascii() => memchr::memchr(*a as u8, b),
            [a, c] if a.is_ascii() && c.is_ascii() => memchr::memchr2(*a as u8, *c as u8, b),
            [a, c, d] if a.is_ascii() && c.is_ascii() && d.is_ascii() => {
                memchr::memchr3(*a as u8, *c as u8, *d as u8, b)
            }
            first => text.find(|c: char| first.contains(&c)),
        }
    }

    /// A completion's prompt, as vLLM encodes it (with the tokenizer's special tokens).
    pub fn prompt(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode(text, true)
    }

    /// A chat request's messages (the OpenAI `messages` array), rendered and encoded as vLLM
    /// does for `/v1/chat/completions`.
    pub fn chat(&self, messages: &Value) -> Result<Vec<u32>, TokenizeError> {
        self.chat_with(messages, &ChatOptions::default())
    }

    /// [`Self::chat`] with the request's other fields that reach the template (tools,
    /// `chat_template_kwargs`, ...).
    pub fn chat_with(
        &self,
        messages: &Value,
        options: &ChatOptions,
    ) -> Result<Vec<u32>, TokenizeError> {
        let pending = self.prepare_chat_with(messages, options)?;
        self.finish(pending)
    }

    /// The cheap half of tokenizing a completion's prompt: nothing is cached, so all of it is
    /// left to [`ModelTokenizer::finish`].
    pub fn prepare_prompt(&self, text: &str) -> Pending {
        Pending {
            uncached_bytes: text.len(),
            parts: vec![Part::Encode {
                text: text.to_owned(),
                special: true,
                key: None,
            }],
        }
    }

    /// The cheap half of tokenizing a chat request: the template rendered, the text split at its
    /// added tokens, and the pieces seen before taken from the cache. What is left to encode
    /// ([`Pending::uncached_bytes`]) tells the caller whether [`ModelTokenizer::finish`] is
    /// worth moving off its event loop.
    pub fn prepare_chat(&self, messages: &Value) -> Result<Pending, TokenizeError> {
        self.prepare_chat_with(messages, &ChatOptions::default())
    }

    /// [`Self::prepare_chat`] with the request's other fields that reach the template.
    pub fn prepare_chat_with(
        &self,
        messages: &Value,
        options: &ChatOptions,
    ) -> Result<Pending, TokenizeError> {
        let text = self.render_chat_with(messages, options)?;
        let Some(cache) = &self.pieces else {
            return Ok(Pending {
                uncached_bytes: text.len(),
                parts: vec![Part::Encode {
                    text,
                    special: false,
                    key: None,
                }],
            });
        };
        let mut pending = Pending {
            parts: Vec::new(),
            uncached_bytes: 0,
        };
        let map = cache.map.lock();
        for piece in self.split(&text) {
            pending.parts.push(match piece {
                Piece::Added(id) => Part::Added(id),
                Piece::Text(t) => {
                    let key = xxh3_64(t.as_bytes());
                    match map.ids.get(&key) {
                        Some(ids) => Part::Cached(Arc::clone(ids)),
                        None => {
                            pending.uncached_bytes += t.len();
                            Part::Encode {
                                text: t.to_owned(),
                                special: false,
                                key: Some(key),
                            }
                        }
                    }
                }
            });
        }
        Ok(pending)
    }

    /// Encodes what [`ModelTokenizer::prepare_chat`] (or `prepare_prompt`) left, caching the new
    /// pieces, and returns the request's token ids.
    pub fn finish(&self, pending: Pending) -> Result<Vec<u32>, TokenizeError> {
        let mut out = Vec::new();
        for part in pending.parts {
            match part {
                Part::Added(id) => out.push(id),
                Part::Cached(ids) => out.extend_from_slice(&ids),
                Part::Encode { text, special, key } => {
                    let ids = self.encode(&text, special)?;
                    out.extend_from_slice(&ids);
                    if let (Some(key), Some(cache)) = (key, &self.pieces) {
                        let mut g = cache.map.lock();
                        if g.tokens + ids.len() > PIECE_CACHE_TOKENS {
                            g.ids.clear();
                            g.tokens = 0;
                        }
                        g.tokens += ids.len();
                        g.ids.insert(key, ids.into());
                    }
                }
            }
        }
        Ok(out)
    }

    /// Whether chat pieces are cached (the load-time check passed).
    pub fn caches_pieces(&self) -> bool {
        self.pieces.is_some()
    }

    /// The chat template's text for `messages`, with the generation prompt.
    pub fn render_chat(&self, messages: &Value) -> Result<String, TokenizeError> {
        self.render_chat_with(messages, &ChatOptions::default())
    }

    /// [`Self::render_chat`] with the request's other fields that reach the template.
    pub fn render_chat_with(
        &self,
        messages: &Value,
        options: &ChatOptions,
    ) -> Result<String, TokenizeError> {
        self.chat
            .as_ref()
            .ok_or_else(|| TokenizeError::Template("the model has no chat template".into()))?
            .render(messages, options)
    }

    /// The same tokenizer, its chat template given `defaults` under each request's own
    /// `chat_template_kwargs`, as vLLM's `--default-chat-template-kwargs` gives them.
    pub fn with_default_chat_template_kwargs(
        mut self,
        defaults: serde_json::Map<String, Value>,
    ) -> Self {
        if let Some(chat) = &mut self.chat {
            chat.defaults = defaults;
        }
        self
    }

    /// The same tokenizer without the piece cache or the byte-level road: every chat request
    /// encoded whole by the `tokenizers` crate, exactly as vLLM does (what a simulated worker
    /// uses, so the gateway's shortcuts are checked against it).
    pub fn whole(mut self) -> Self {
        self.pieces = None;
        self.byte_level = None;
        self
    }

    /// `text` encoded, with or without the tokenizer's special tokens.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        let Some(road) = &self.byte_level else {
            return self.encode_by_the_crate(text, special);
        };
        let encode_err = |e: tokenizers::Error| TokenizeError::Encode(e.to_string());
        let mut ids = match special {
            true => self.special_prefix.clone(),
            false => Vec::new(),
        };
        let mut buf = String::new();
        for piece in self.split(text) {
            match piece {
                Piece::Added(id) => ids.push(id),
                Piece::Text(t) => road
                    .encode_into(&self.tokenizer, t, &mut buf, &mut ids)
                    .map_err(encode_err)?,
            }
        }
        Ok(ids)
    }

    /// `text` encoded by the `tokenizers` crate's own pipeline.
    fn encode_by_the_crate(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode_fast(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// Whether encoding takes the byte-level road (the load-time check passed).
    pub fn takes_the_byte_level_road(&self) -> bool {
        self.byte_level.is_some()
    }

    /// What this tokenizer can do, in a few words for the log and `serve --check`: whether it
    /// has a chat template, and which of the load-time checks it passed (the piece cache, heads,
    /// the byte-level road). A check it failed costs time, not exactness.
    pub fn summary(&self) -> String {
        let say = |on: bool, what: &str| match on {
            true => what.to_owned(),
            false => format!("no {what}"),
        };
        [
            say(self.chat.is_some(), "chat template"),
            say(self.caches_pieces(), "piece cache"),
            say(self.encodes_heads(), "heads"),
            say(self.takes_the_byte_level_road(), "byte-level road"),
        ]
        .join(", ")
    }

    /// Token ids back to text, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }
}

/// The conversation the load-time checks render: spaces around and inside messages, a blank line,
/// text that is not ASCII.
fn check_conversation() -> Value {
    serde_json::json!([
        {"role": "system", "content": " You are a helpful assistant.\n Be brief. "},
        {"role": "user", "content": "Hello there,  how are you?\n\n"},
        {"role": "assistant", "content": "Fine, thanks!"},
        {"role": "user", "content": "Übersetze: «prefix caching» 漢字 🙂"},
    ])
}

/// A request half tokenized: see [`ModelTokenizer::prepare_chat`].
pub struct Pending {
    parts: Vec<Part>,
    uncached_bytes: usize,
}

impl Pending {
    /// Bytes of text the cache did not have, still to encode (about 0.05 ms per KB with a
    /// Llama 3 vocabulary).
    pub fn uncached_bytes(&self) -> usize {
        self.uncached_bytes
    }

    /// Whether encoding the rest would fill the piece cache (a chat's new pieces), so that it
    /// is worth finishing after a head routed the request.
    pub fn fills_cache(&self) -> bool {
        self.parts
            .iter()
            .any(|p| matches!(p, Part::Encode { key: Some(_), .. }))
    }
}

enum Part {
    Added(u32),
    Cached(Arc<[u32]>),
    Encode {
        text: String,
        special: bool,
        /// The piece cache's key, for a chat piece.
        key: Option<u64>,
    },
}

enum Piece<'t> {
    Added(u32),
    Text(&'t str),
}

/// The chain hashes of every full `block`-token block of `tokens`, as
/// [`crate::kv_events::chain`] keys a worker's blocks.
pub fn block_chain(tokens: &[u32], block: usize) -> Vec<u64> {
    block_chain_from(crate::kv_events::ROOT, tokens, block)
}

/// [`block_chain`] from `root` rather than [`crate::kv_events::ROOT`]: a salted prompt's
/// ([`crate::kv_events::salted_root`]).
pub fn block_chain_from(root: u64, tokens: &[u32], block: usize) -> Vec<u64> {
    let mut parent = root;
    tokens
        .chunks_exact(block.max(1))
        .map(|b| {
            parent = crate::kv_events::chain(parent, b);
            parent
        })
        .collect()
}
