//! The simulator's tokenizer: a deterministic, reversible word-piece split.
//!
//! Text is cut into words (a word keeps its leading whitespace, as byte-level BPE vocabularies do)
//! and each word into pieces of at most four bytes on character boundaries, which lands near the
//! ~4 characters per token of English text under common LLM tokenizers. A piece's id is its bytes
//! packed little-endian into a `u32`, so `detokenize(tokenize(t)) == t` for any text. It shares
//! nothing with the gateway's routing key: the gateway hashes fixed byte blocks of the JSON fields,
//! the simulator caches 16-token blocks of this split, exactly as a real worker's tokenizer would
//! differ from the gateway's view.
//!
//! A worker can instead tokenize with a model's `tokenizer.json` and chat template
//! ([`SimTokenizer::Model`]), as a vLLM worker serving that model does: then its blocks carry the
//! model's token ids, and a gateway that tokenizes requests the same way can compare them with the
//! blocks its KV cache events name. Output tokens are then single-token words of that vocabulary.

use std::{path::Path, sync::Arc};

use serde_json::Value;

use crate::tokenize::{ModelTokenizer, TokenizeError};

/// Token id the simulator's own tokenizer puts before every prompt (Llama-style BOS).
pub const BOS: u32 = 1;

/// Short words, each one token under the simulator's tokenizer (leading space + ≤3 letters) and
/// under common BPE vocabularies.
const WORDS: &[&str] = &[
    " the", " of", " and", " to", " in", " is", " it", " you", " was", " for", " on", " are",
    " as", " his", " at", " be", " had", " by", " but", " not", " all", " we", " can", " use",
    " an", " she", " do", " how", " if", " up", " out", " so", " her", " him", " my", " new",
    " now", " way", " day", " may", " see", " two", " get", " sun", " sea", " old", " red", " run",
    " big", " low", " far", " key", " map", " end",
];

/// What a simulated worker tokenizes with.
#[derive(Clone, Default)]
pub enum SimTokenizer {
    /// The simulator's own split (below).
    #[default]
    Own,
    /// A model's tokenizer, encoding every request whole as vLLM does.
    Model(Arc<ModelVocab>),
}

/// A model's tokenizer and the words of its vocabulary the simulated engine generates.
pub struct ModelVocab {
    tokenizer: ModelTokenizer,
    /// Single-token words: (id, text).
    words: Vec<(u32, &'static str)>,
}

impl SimTokenizer {
    /// Loads a model's `tokenizer.json` and, for chat requests, its `tokenizer_config.json`.
    pub fn load(tokenizer_json: &Path, config: Option<&Path>) -> Result<Self, TokenizeError> {
        let tokenizer = ModelTokenizer::load(tokenizer_json, config)?.whole();
        let words: Vec<(u32, &'static str)> = WORDS
            .iter()
            .filter_map(|w| match tokenizer.encode(w, false).ok()?.as_slice() {
                [id] => Some((*id, *w)),
                _ => None,
            })
            .collect();
        if words.is_empty() {
            return Err(TokenizeError::Encode(format!(
                "{}: none of the simulator's output words is one token",
                tokenizer_json.display()
            )));
        }
        Ok(Self::Model(Arc::new(ModelVocab { tokenizer, words })))
    }

    /// A completion's string prompt, with the tokenizer's special tokens.
    pub fn prompt(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match self {
            Self::Own => Ok(std::iter::once(BOS).chain(tokenize(text)).collect()),
            Self::Model(m) => m.tokenizer.prompt(text),
        }
    }

    /// Text rendered by the chat template (without special-token ids of its own), then encoded
    /// as vLLM encodes a chat request.
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>, TokenizeError> {
        match self {
            Self::Own => Ok(std::iter::once(BOS).chain(tokenize(rendered)).collect()),
            Self::Model(m) => m.tokenizer.encode(rendered, false),
        }
    }

    /// `text` encoded, with or without special tokens (`/tokenize`).
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        match self {
            Self::Own if special => self.prompt(text),
            Self::Own => Ok(tokenize(text)),
            Self::Model(m) => m.tokenizer.encode(text, special),
        }
    }

    /// Token ids back to text (`/detokenize`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        match self {
            Self::Own => {
                let ids: Vec<u32> = ids.iter().copied().filter(|i| *i != BOS).collect();
                Ok(detokenize(&ids))
            }
            Self::Model(m) => m.tokenizer.decode(ids),
        }
    }

    /// The `k`th output token for `seed` and its text: deterministic, so a client can check a
    /// relayed stream.
    pub fn output_token(&self, seed: u64, k: usize) -> (u32, String) {
        let roll = super::engine::splitmix(seed.wrapping_add(k as u64));
        match self {
            Self::Own => {
                let w = WORDS[(roll % WORDS.len() as u64) as usize];
                let ids = tokenize(w);
                debug_assert_eq!(ids.len(), 1, "{w:?} must be one token");
                (ids[0], w.to_owned())
            }
            Self::Model(m) => {
                let (id, w) = m.words[(roll % m.words.len() as u64) as usize];
                (id, w.to_owned())
            }
        }
    }
}

impl ModelVocab {
    /// The model's chat template over `messages` (an OpenAI `messages` array) and the request's
    /// other fields that reach it.
    pub fn render_chat(
        &self,
        messages: &Value,
        options: &crate::tokenize::ChatOptions,
    ) -> Result<String, TokenizeError> {
        self.tokenizer.render_chat_with(messages, options)
    }
}

impl std::fmt::Debug for SimTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Own => f.write_str("SimTokenizer::Own"),
            Self::Model(m) => write!(f, "SimTokenizer::Model({} words)", m.words.len()),
        }
    }
}

/// Longest piece in bytes.
const PIECE_BYTES: usize = 4;

pub fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / 3 + 1);
    for word in words(text) {
        let mut piece_start = 0;
        let mut last = 0;
        for (i, ch) in word.char_indices() {
            let end = i + ch.len_utf8();
            if end - piece_start > PIECE_BYTES && i > piece_start {
                out.push(pack(&word.as_bytes()[piece_start..i]));
                piece_start = i;
            }
            last = end;
        }
        if last > piece_start {
            out.push(pack(&word.as_bytes()[piece_start..last]));
        }
    }
    out
}

pub fn detokenize(ids: &[u32]) -> String {
    let mut bytes = Vec::with_capacity(ids.len() * 4);
    for id in ids {
        bytes.extend(id.to_le_bytes().iter().copied().take_while(|b| *b != 0));
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Splits before every whitespace run that follows a non-space, and around ASCII punctuation.
fn words(text: &str) -> impl Iterator<Item = &str> {
    let mut start = 0;
    let mut prev: Option<char> = None;
    let mut cuts = Vec::new();
    for (i, ch) in text.char_indices() {
        if let Some(p) = prev {
            let boundary = (ch.is_whitespace() && !p.is_whitespace())
                || ch.is_ascii_punctuation()
                || (p.is_ascii_punctuation() && !ch.is_whitespace());
            if boundary {
                cuts.push(&text[start..i]);
                start = i;
            }
        }
        prev = Some(ch);
    }
    if start < text.len() {
        cuts.push(&text[start..]);
    }
    cuts.into_iter()
}

fn pack(bytes: &[u8]) -> u32 {
    let mut b = [0u8; 4];
    b[..bytes.len()].copy_from_slice(bytes);
    u32::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn english_text_is_about_four_characters_a_token() {
        let text = "The quick brown fox jumps over the lazy dog, then naps in the afternoon sun.";
        let n = tokenize(text).len();
        let ratio = text.len() as f64 / n as f64;
        assert!(
            (2.5..=4.5).contains(&ratio),
            "{ratio} chars/token ({n} tokens)"
        );
    }

    #[test]
    fn words_keep_leading_space() {
        let ids = tokenize("hi there");
        assert_eq!(
            ids.iter().map(|i| detokenize(&[*i])).collect::<Vec<_>>(),
            ["hi", " the", "re"]
        );
    }

    proptest! {
        #[test]
        fn round_trips_any_text(s in "\\PC{0,200}") {
            prop_assert_eq!(detokenize(&tokenize(&s)), s);
        }

        #[test]
        fn a_shared_text_prefix_gives_a_shared_token_prefix(a in "[a-z ]{0,80}", b in "[a-z ]{0,40}") {
            let whole = tokenize(&format!("{a}. {b}"));
            let head = tokenize(&format!("{a}."));
            prop_assert_eq!(&whole[..head.len()], &head[..]);
        }
    }
}
