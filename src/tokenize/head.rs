//! Heads: a request's leading token ids, encoding only as much new text as routing needs (the
//! module docs of [`crate::tokenize`] say why that is enough and how it is checked).

use super::{ModelTokenizer, Part, Pending, TokenizeError};

/// New text a request's head encodes first: about 30 tokens of English, which complete the
/// first block past a cached prefix at vLLM's default block size of 16. The pre-tokenizer's regex
/// is most of a head's cost (Oniguruma's search, about 500 instructions a byte with Llama 3's
/// `tokenizer.json`, under callgrind), so it starts small.
pub const HEAD_BYTES: usize = 128;

/// Splits at the end of a cut text that the text after the cut could have changed: the
/// pre-tokenizer's patterns look one character past a match (`\s+(?!\S)`) and a run's
/// last match depends on where the run ends.
const UNSURE_SPLITS: usize = 2;

/// Text full of what pre-tokenizers' patterns look ahead at or treat apart (runs of spaces and
/// line ends, digits, contractions, punctuation, other scripts, emoji, text like a token): what
/// the load-time checks encode.
pub(super) const CHECK_TEXT: &str =
    "Hello,  world!\n\n  The year 2024 had 365 days; 1234567 items...\t\
    Tabs\t\tand   spaces   \n\r\nCRLF. Don't stop: it's «quoted» — Übersetze 漢字 🙂🙂 \
    ??!! x=y+z; foo_bar(baz[10]) <not a token> 3.14159 end.   \n\n";

/// A request's leading token ids: see [`ModelTokenizer::head`].
#[derive(Debug)]
pub struct Head {
    pub ids: Vec<u32>,
    /// Tokens of the prompt after `ids`, estimated (0: `ids` is the whole prompt).
    pub rest_tokens: usize,
}

impl ModelTokenizer {
    /// The load-time check of heads: at every cut of a sample text, with and without the special
    /// tokens, the head's ids must start the whole's. Added tokens that strip the spaces around
    /// them are matched before the pre-tokenizer and could straddle a cut: no heads then.
    pub(super) fn heads_encode_like_the_whole(&self) -> bool {
        let stripping = self
            .tokenizer
            .get_added_tokens_decoder()
            .values()
            .any(|t| t.lstrip || t.rstrip || t.single_word);
        if stripping || self.tokenizer.get_pre_tokenizer().is_none() {
            return false;
        }
        [false, true].into_iter().all(|special| {
            let Ok(whole) = self.encode(CHECK_TEXT, special) else {
                return false;
            };
            (0..=CHECK_TEXT.len())
                .filter(|&c| CHECK_TEXT.is_char_boundary(c))
                .all(|c| {
                    self.encode_head(CHECK_TEXT, c, special)
                        .is_ok_and(|(head, _)| whole.starts_with(&head))
                })
        })
    }

    /// The ids of the longest start of `text` within `max_bytes` that ends where the whole
    /// text's tokenization is known to split, and where it ends. The tokenizer's normalizer and
    /// pre-tokenizer run once on the first `max_bytes`; the last [`UNSURE_SPLITS`] of their
    /// splits, which the bytes after the cut could have changed, are dropped, and the model
    /// encodes the rest split by split, as encoding the whole does. `text` holds no added token,
    /// and with `special` the ids start with what the post-processor puts before a text.
    fn encode_head(
        &self,
        text: &str,
        max_bytes: usize,
        special: bool,
    ) -> Result<(Vec<u32>, usize), TokenizeError> {
        if max_bytes >= text.len() {
            return Ok((self.encode(text, special)?, text.len()));
        }
        let mut end = max_bytes;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let encode_err = |e: tokenizers::Error| TokenizeError::Encode(e.to_string());
        let mut ids = match special {
            true => self.special_prefix.clone(),
            false => Vec::new(),
        };
        // With the byte-level road, the splits are taken before the byte mapping (which splits
        // nothing further) and each is mapped on its own.
        if let Some(road) = &self.byte_level {
            let mut buf = String::new();
            return road
                .with_splits(&self.tokenizer, &text[..end], |splits| {
                    let Some(keep) = splits.len().checked_sub(UNSURE_SPLITS).filter(|&k| k > 0)
                    else {
                        return Ok(0);
                    };
                    for (piece, _) in &splits[..keep] {
                        road.tokenize(&self.tokenizer, piece, &mut buf, &mut ids)?;
                    }
                    Ok(splits[keep].1)
                })
                .map(|cut| (ids, cut))
                .map_err(encode_err);
        }
        let split = self.pre_tokenize(&text[..end]).map_err(encode_err)?;
        let splits = split.get_splits(
            tokenizers::OffsetReferential::Original,
            tokenizers::OffsetType::Byte,
        );
        let Some(keep) = splits.len().checked_sub(UNSURE_SPLITS).filter(|&k| k > 0) else {
            return Ok((ids, 0));
        };
        let model = self.tokenizer.get_model();
        for (piece, _, _) in &splits[..keep] {
            let tokens = tokenizers::Model::tokenize(model, piece).map_err(encode_err)?;
            ids.extend(tokens.iter().map(|t| t.id));
        }
        Ok((ids, splits[keep].1 .0))
    }

    /// `text` normalized and pre-tokenized by the tokenizer's own steps.
    fn pre_tokenize(&self, text: &str) -> tokenizers::Result<tokenizers::PreTokenizedString> {
        let mut normalized = tokenizers::NormalizedString::from(text);
        if let Some(n) = self.tokenizer.get_normalizer() {
            tokenizers::Normalizer::normalize(n, &mut normalized)?;
        }
        let mut split = tokenizers::PreTokenizedString::from(normalized);
        if let Some(p) = self.tokenizer.get_pre_tokenizer() {
            tokenizers::PreTokenizer::pre_tokenize(p, &mut split)?;
        }
        Ok(split)
    }

    /// Whether [`ModelTokenizer::head`] can stop short of the whole text (the load-time check
    /// passed).
    pub fn encodes_heads(&self) -> bool {
        self.heads
    }

    /// The request's leading token ids, encoding at most `max_new_bytes` of the text the cache
    /// did not have (the first such piece is cut where the tokenizer splits, see
    /// `ModelTokenizer::encode_head`), and an estimate of the tokens after them. With heads off
    /// the cut piece contributes nothing, so the head ends where that piece starts.
    pub fn head(&self, pending: &Pending, max_new_bytes: usize) -> Result<Head, TokenizeError> {
        let mut ids = Vec::new();
        let mut budget = max_new_bytes;
        let mut parts = pending.parts.iter();
        while let Some(part) = parts.next() {
            match part {
                Part::Added(id) => ids.push(*id),
                Part::Cached(cached) => ids.extend_from_slice(cached),
                Part::Encode { text, special, .. } if text.len() <= budget => {
                    ids.extend(self.encode(text, *special)?);
                    budget -= text.len();
                }
                Part::Encode { text, special, .. } => {
                    // A completion's prompt is not split at its added tokens: the text before
                    // the first one is encoded alone by the whole too, so a cut stays before it.
                    let alone = self.first_added(text).unwrap_or(text.len());
                    let (head, cut) = match () {
                        _ if !self.heads => (Vec::new(), 0),
                        _ => self.encode_head(&text[..alone], budget, *special)?,
                    };
                    // Tokens per byte of this text as its head encoded (4 bytes a token before).
                    let rate = match head.len() {
                        0 => 0.25,
                        n => n as f64 / cut as f64,
                    };
                    let mut rest = (text.len() - cut) as f64 * rate;
                    for later in parts {
                        rest += match later {
                            Part::Added(_) => 1.0,
                            Part::Cached(cached) => cached.len() as f64,
                            Part::Encode { text, .. } => text.len() as f64 * rate,
                        };
                    }
                    ids.extend(head);
                    return Ok(Head {
                        ids,
                        rest_tokens: (rest.round() as usize).max(1),
                    });
                }
            }
        }
        Ok(Head {
            ids,
            rest_tokens: 0,
        })
    }

    /// Where the first added token in `text` starts.
    fn first_added(&self, text: &str) -> Option<usize> {
        let mut at = 0;
        while let Some(off) = self.next_added_start(&text[at..]) {
            at += off;
            if self.added.starting(&text[at..]).is_some() {
                return Some(at);
            }
            at += text[at..].chars().next().map_or(1, char::len_utf8);
        }
        None
    }
}
