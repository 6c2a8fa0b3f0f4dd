//! Byte-level BPE tokenizers (GPT-2's, Llama 3's, Qwen's) encoded past the `tokenizers` crate's
//! last pre-tokenizing step.
//!
//! Such a tokenizer's pre-tokenizer ends in `ByteLevel`, which rewrites every byte of every split
//! as a printable character (GPT-2's byte-to-unicode table) before the model sees it. The crate
//! does that through its general `NormalizedString` transform, which records an alignment for
//! every byte and looks each byte up in a hash map: with Llama 3's `tokenizer.json` that step was
//! about 40% of the instructions a 128-byte head cost to encode (callgrind, 2026-12-07). Here the
//! steps before it run as the tokenizer runs them, and the bytes are mapped through a table into
//! one reused buffer. Where those steps are one `Split` and nothing normalizes the text, even
//! they are skipped: the pieces are read off the split's own regex (see `ByteLevelRoad::direct`).
//!
//! The ids must be the crate's own. The tokenizer's shape is matched strictly
//! ([`ByteLevelRoad::of`]), and [`super::ModelTokenizer`] compares the two roads on sample texts
//! when it loads, keeping the crate's where they differ.

use tokenizers::{
    pre_tokenizers::{byte_level::ByteLevel, split::Split, PreTokenizerWrapper},
    Model, NormalizedString, Normalizer, OffsetReferential, OffsetType, PreTokenizedString,
    PreTokenizer, SplitDelimiterBehavior, Tokenizer,
};

/// GPT-2's split pattern, which `ByteLevel` with `use_regex` applies itself before mapping.
const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The pre-tokenizing steps before a final byte-level mapping, and the mapping as a table.
pub(super) struct ByteLevelRoad {
    /// Run in order on the text, as the tokenizer's pre-tokenizer runs them.
    steps: Vec<PreTokenizerWrapper>,
    /// The steps are one `Split` that isolates its pattern's matches, and nothing normalizes the
    /// text: its splits are then read straight off the pattern's matches in the text, without the
    /// crate's `NormalizedString` for each (its slicing was about 45% of splitting a long text).
    direct: bool,
    /// Each byte's character in the byte-level alphabet, UTF-8 encoded (at most 2 bytes).
    table: [([u8; 2], u8); 256],
}

impl ByteLevelRoad {
    /// The road for `tokenizer`, when it is of a shape this module reproduces: a pre-tokenizer
    /// that is `ByteLevel` without `add_prefix_space`, alone or last in a `Sequence` of other
    /// steps; no truncation or padding configured; special tokens split out of the text; and
    /// added tokens matched on the raw text (none strips the spaces around it or is normalized).
    pub(super) fn of(tokenizer: &Tokenizer) -> Option<Self> {
        if tokenizer.get_truncation().is_some()
            || tokenizer.get_padding().is_some()
            || tokenizer.get_encode_special_tokens()
        {
            return None;
        }
        let plain =
            |t: &tokenizers::AddedToken| !t.lstrip && !t.rstrip && !t.single_word && !t.normalized;
        if !tokenizer.get_added_tokens_decoder().values().all(plain) {
            return None;
        }
        let mapping_only = |b: &ByteLevel| !b.add_prefix_space && !b.use_regex;
        let steps = match tokenizer.get_pre_tokenizer()? {
            PreTokenizerWrapper::ByteLevel(b) if !b.add_prefix_space && b.use_regex => {
                let split = Split::new(
                    tokenizers::pre_tokenizers::split::SplitPattern::Regex(GPT2_SPLIT.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .ok()?;
                vec![PreTokenizerWrapper::Split(split)]
            }
            PreTokenizerWrapper::ByteLevel(b) if mapping_only(b) => Vec::new(),
            PreTokenizerWrapper::Sequence(seq) => match seq.as_ref() {
                [before @ .., PreTokenizerWrapper::ByteLevel(b)]
                    if mapping_only(b)
                        && !before.iter().any(|s| {
                            matches!(
                                s,
                                PreTokenizerWrapper::ByteLevel(_)
                                    | PreTokenizerWrapper::Sequence(_)
                            )
                        }) =>
                {
                    before.to_vec()
                }
                _ => return None,
            },
            _ => return None,
        };
        let direct = tokenizer.get_normalizer().is_none()
            && matches!(steps.as_slice(), [PreTokenizerWrapper::Split(s)]
                if matches!(s.behavior, SplitDelimiterBehavior::Isolated) && !s.invert);
        Some(Self {
            steps,
            direct,
            table: byte_table(),
        })
    }

    /// `text` normalized and split as the tokenizer does before its byte mapping, handed to `f`
    /// as each split's text and where it starts in `text`.
    pub(super) fn with_splits<R>(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        f: impl FnOnce(&[(&str, usize)]) -> tokenizers::Result<R>,
    ) -> tokenizers::Result<R> {
        if let (true, [PreTokenizerWrapper::Split(split)]) = (self.direct, self.steps.as_slice()) {
            // What the crate's `Split` does with `Isolated`: every match a split, and every run
            // between matches; empty ones dropped.
            let mut splits = Vec::new();
            let mut at = 0;
            for (start, end) in split.regex.find_iter(text) {
                if at < start {
                    splits.push((&text[at..start], at));
                }
                if start < end {
                    splits.push((&text[start..end], start));
                }
                at = end;
            }
            if at < text.len() {
                splits.push((&text[at..], at));
            }
            return f(&splits);
        }
        let mut normalized = NormalizedString::from(text);
        if let Some(n) = tokenizer.get_normalizer() {
            n.normalize(&mut normalized)?;
        }
        let mut pre = PreTokenizedString::from(normalized);
        for step in &self.steps {
            step.pre_tokenize(&mut pre)?;
        }
        let splits: Vec<(&str, usize)> = pre
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(piece, (start, _), _)| (piece, start))
            .collect();
        f(&splits)
    }

    /// The ids of one split: its bytes mapped into the byte-level alphabet (in `buf`), then the
    /// model, appended to `out`.
    pub(super) fn tokenize(
        &self,
        tokenizer: &Tokenizer,
        piece: &str,
        buf: &mut String,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        buf.clear();
        let mut bytes = std::mem::take(buf).into_bytes();
        for &b in piece.as_bytes() {
            let (utf8, len) = &self.table[usize::from(b)];
            bytes.extend_from_slice(&utf8[..usize::from(*len)]);
        }
        // Every entry of the table is a whole character's UTF-8.
        *buf = String::from_utf8(bytes).map_err(|e| e.to_string())?;
        let tokens = tokenizer.get_model().tokenize(buf)?;
        out.extend(tokens.iter().map(|t| t.id));
        Ok(())
    }

    /// `text` (holding no added token) encoded, appended to `out`.
    pub(super) fn encode_into(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        buf: &mut String,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        self.with_splits(tokenizer, text, |splits| {
            splits
                .iter()
                .try_for_each(|(piece, _)| self.tokenize(tokenizer, piece, buf, out))
        })
    }
}

/// GPT-2's byte-to-unicode table: printable Latin-1 bytes stand for themselves, the other 68
/// bytes for the code points from 256 up, in byte order.
fn byte_table() -> [([u8; 2], u8); 256] {
    let mut table = [([0u8; 2], 0u8); 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            next += 1;
            next - 1
        };
        let c = char::from_u32(code).expect("below 512: a scalar value");
        let mut utf8 = [0u8; 2];
        let len = c.encode_utf8(&mut utf8).len();
        table[usize::from(b)] = (utf8, len as u8);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_gpt2s() {
        let t = byte_table();
        let ch = |b: u8| {
            let (utf8, len) = t[usize::from(b)];
            std::str::from_utf8(&utf8[..usize::from(len)])
                .expect("utf-8")
                .chars()
                .next()
                .expect("a char")
        };
        // The space and the newline are the best-known entries: `Ġ` and `Ċ`.
        assert_eq!(ch(b' '), 'Ġ');
        assert_eq!(ch(b'\n'), 'Ċ');
        assert_eq!(ch(b'a'), 'a');
        assert_eq!(ch(0), 'Ā');
        assert_eq!(ch(0x7F), 'ġ');
        assert_eq!(ch(0xAD), 'Ń');
        assert_eq!(ch(0xFF), 'ÿ');
        let mut all: Vec<char> = (0..=255u8).map(ch).collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 256, "a byte's character is its own");
    }
}
