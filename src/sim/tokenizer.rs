//! The simulator's tokenizer: a deterministic, reversible word-piece split.
//!
//! Text is cut into words (a word keeps its leading whitespace, as byte-level BPE vocabularies do)
//! and each word into pieces of at most four bytes on character boundaries, which lands near the
//! ~4 characters per token of English text under common LLM tokenizers. A piece's id is its bytes
//! packed little-endian into a `u32`, so `detokenize(tokenize(t)) == t` for any text. It shares
//! nothing with the gateway's routing key: the gateway hashes fixed byte blocks of the JSON fields,
//! the simulator caches 16-token blocks of this split, exactly as a real worker's tokenizer would
//! differ from the gateway's view.

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

/// One token's text (may be a partial character for a lone multi-byte piece id).
pub fn piece(id: u32) -> String {
    detokenize(&[id])
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
            ids.iter().map(|i| piece(*i)).collect::<Vec<_>>(),
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
