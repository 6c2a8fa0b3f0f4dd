//! Tokenizing requests as the worker does: a committed byte-level BPE in the Hugging Face format
//! (`tests/tokenize/tiny-tokenizer.json`, made by `make_tiny_tokenizer.py`) and the chat template
//! of the CPU vLLM test model. The expected ids and text below were produced by the reference
//! implementations (Python `tokenizers` 0.22 and `jinja2`, the libraries vLLM uses) on the same
//! files; `tests/real_vllm.rs` compares with a running vLLM's `/tokenize`.

use std::path::PathBuf;

use kvroute::{
    kv_events::{chain, ROOT},
    tokenize::{block_chain, ModelTokenizer},
};
use serde_json::json;

fn path(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(p)
}

fn tiny() -> ModelTokenizer {
    ModelTokenizer::load(
        &path("tests/tokenize/tiny-tokenizer.json"),
        Some(&path("tests/vllm/model/tokenizer_config.json")),
    )
    .unwrap()
}

#[test]
fn a_prompt_is_encoded_with_the_tokenizers_special_tokens() {
    assert_eq!(
        tiny()
            .prompt("The quick brown fox saves the prefill.")
            .unwrap(),
        [0, 304, 73, 395, 398, 82, 388, 364, 272, 263, 380, 18]
    );
}

#[test]
fn chat_messages_go_through_the_template_then_the_tokenizer() {
    let t = tiny();
    let messages = json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": " Route this request. "}]},
    ]);
    assert_eq!(
        t.render_chat(&messages).unwrap(),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful \
         assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nRoute this \
         request.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    assert_eq!(
        t.chat(&messages).unwrap(),
        [
            0, 2, 87, 93, 87, 88, 73, 81, 3, 203, 203, 305, 378, 276, 390, 80, 379, 322, 344, 88,
            18, 4, 2, 89, 87, 271, 3, 203, 203, 303, 88, 73, 262, 322, 350, 275, 272, 88, 18, 4, 2,
            69, 341, 322, 344, 88, 3, 203, 203
        ]
    );
}

#[test]
fn a_model_without_a_template_refuses_chat_and_a_missing_file_is_an_error() {
    let t = ModelTokenizer::load(&path("tests/tokenize/tiny-tokenizer.json"), None).unwrap();
    assert!(t.chat(&json!([{"role": "user", "content": "hi"}])).is_err());
    assert!(ModelTokenizer::load(&path("tests/tokenize/nope.json"), None).is_err());
}

#[test]
fn block_chains_key_full_blocks_as_the_event_feed_does() {
    let tokens: Vec<u32> = (0..10).collect();
    let a = chain(ROOT, &[0, 1, 2, 3]);
    let b = chain(a, &[4, 5, 6, 7]);
    assert_eq!(
        block_chain(&tokens, 4),
        [a, b],
        "the partial last block is left out"
    );
}

#[test]
fn cached_pieces_give_the_same_ids_as_encoding_the_whole() {
    let t = tiny();
    assert!(
        t.caches_pieces(),
        "the load-time check passes for a byte-level BPE"
    );
    let uncached = ModelTokenizer::load(&path("tests/tokenize/tiny-tokenizer.json"), None).unwrap();
    let mut messages = vec![json!({"role": "system", "content": "You are a helpful assistant."})];
    for turn in 0..5 {
        // A `<` that starts no added token, and text that is not ASCII, between the real ones.
        messages.push(json!({"role": "user", "content": format!("question {turn}: is x < y in <b>«fox»</b>?")}));
        let ids = t.chat(&json!(messages)).unwrap();
        // The reference: the rendered text encoded whole, without special tokens.
        let text = t.render_chat(&json!(messages)).unwrap();
        let whole = {
            // `prompt` adds the post-processor's BOS; the template already wrote one.
            let mut w = uncached.prompt(&text).unwrap();
            w.remove(0);
            w
        };
        assert_eq!(ids, whole, "turn {turn}");
        messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
    }
}

/// Tokenizing in two halves: `prepare_chat` takes the pieces seen before from the cache and
/// leaves only new text to encode (what the gateway moves off its event loop when long);
/// `finish` gives the same ids as encoding at once.
#[test]
fn only_new_text_is_left_to_encode() {
    let t = tiny();
    let system = "You route requests to the worker holding their cache. ".repeat(20);
    let convo = |turns: usize| {
        let mut m = vec![json!({"role": "system", "content": system})];
        for k in 0..turns {
            m.push(json!({"role": "user", "content": format!("question {k}")}));
            m.push(json!({"role": "assistant", "content": format!("answer {k}")}));
        }
        m.push(json!({"role": "user", "content": "the new question"}));
        json!(m)
    };
    let first = t.prepare_chat(&convo(1)).unwrap();
    assert!(first.uncached_bytes() > system.len(), "nothing seen yet");
    assert_eq!(
        t.finish(first).unwrap(),
        t.render_chat(&convo(1))
            .map(|text| {
                let mut w = t.prompt(&text).unwrap();
                w.remove(0); // the template wrote the BOS itself
                w
            })
            .unwrap()
    );
    // The next turn: only its two new messages' text (and the roles' headers) is new.
    let next = t.prepare_chat(&convo(2)).unwrap();
    assert!(next.uncached_bytes() < 64, "{}", next.uncached_bytes());
    let ids = t.finish(next).unwrap();
    assert_eq!(ids, t.chat(&convo(2)).unwrap());
    // A completion's prompt is not cached: all of it is left.
    assert_eq!(t.prepare_prompt("abc def").uncached_bytes(), 7);
}

/// Pieces of text that property tests join at random: what a pre-tokenizer's patterns look ahead
/// at or treat apart (runs of spaces, line ends, digits, punctuation, contractions in either
/// case), text that is not ASCII (a combining mark, a no-break and a zero-width space), and an
/// added token and a piece of one.
const PIECES: &[&str] = &[
    "the",
    " fox",
    "  ",
    " ",
    "\n",
    "\n\n",
    "\r\n",
    "\t",
    "123",
    "4",
    "...",
    "!?",
    "'s",
    "'ll",
    "'LL",
    "«",
    "Ü",
    "U\u{308}",
    "漢字",
    "🙂",
    "\u{a0}",
    "\u{200b}",
    "<",
    "<|eot_id|>",
    "x=y",
    "_",
];

/// Routing needs only a prompt's head when no worker holds its first new blocks. At any budget,
/// on text full of what a pre-tokenizer's patterns look ahead at (runs of spaces, newlines,
/// digits, punctuation, text that is not ASCII), a head is the start of the whole prompt's ids,
/// and its estimate of the tokens after is 0 exactly when it is the whole.
#[test]
fn a_head_is_the_start_of_the_whole_prompt_at_any_budget() {
    use proptest::prelude::*;
    let t = tiny();
    assert!(
        t.encodes_heads(),
        "the load-time check passes for a byte-level BPE"
    );
    let uncached = tiny().whole();
    let piece = prop::sample::select(PIECES.to_vec());
    let text = prop::collection::vec(piece, 0..80).prop_map(|p| p.concat());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 300,
        ..ProptestConfig::default()
    });
    runner
        .run(&(text.clone(), text, 0usize..400), |(system, user, budget)| {
            // A completion's prompt, with the tokenizer's special tokens.
            let whole = t.prompt(&user).unwrap();
            let head = t.head(&t.prepare_prompt(&user), budget).unwrap();
            prop_assert!(whole.starts_with(&head.ids), "{user:?} at {budget}: {head:?}");
            prop_assert_eq!(head.rest_tokens == 0, head.ids == whole);
            // A chat whose system prompt was seen before (cached) and whose message is new.
            let messages = |u: &str| json!([{"role": "system", "content": system}, {"role": "user", "content": u}]);
            t.chat(&json!([{"role": "system", "content": system}])).unwrap();
            let whole = uncached.chat(&messages(&user)).unwrap();
            let head = t.head(&t.prepare_chat(&messages(&user)).unwrap(), budget).unwrap();
            prop_assert!(whole.starts_with(&head.ids), "{user:?} at {budget}: {head:?}");
            prop_assert_eq!(head.rest_tokens == 0, head.ids == whole);
            Ok(())
        })
        .unwrap();
}

/// The tiny tokenizer with the top-level fields of its `tokenizer.json` set to `patch`'s, loaded
/// twice: as the gateway loads it, and as the simulated worker does (the `tokenizers` crate's
/// road only).
fn tiny_patched(name: &str, patch: &serde_json::Value) -> [ModelTokenizer; 2] {
    let text = std::fs::read_to_string(path("tests/tokenize/tiny-tokenizer.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (key, value) in patch.as_object().unwrap() {
        v[key] = value.clone();
    }
    let file = std::env::temp_dir().join(format!("kvroute-{}-{name}.json", std::process::id()));
    std::fs::write(&file, v.to_string()).unwrap();
    let config = path("tests/vllm/model/tokenizer_config.json");
    let load = || ModelTokenizer::load(&file, Some(&config)).unwrap();
    let both = [load(), load().whole()];
    std::fs::remove_file(&file).unwrap();
    both
}

/// Byte-level tokenizers are encoded past the `tokenizers` crate's last pre-tokenizing step
/// (`src/tokenize/byte_level.rs`), and whatever the text, the ids are the crate's own. Three
/// shapes take that road: GPT-2's (the tiny tokenizer: `ByteLevel` splitting on its own
/// pattern), Llama 3's (a `Split` on Llama 3's pattern, then `ByteLevel` mapping only) and
/// Qwen2's (the same behind an NFC normalizer). Two it does not reproduce keep the crate's road
/// and its ids: a space put before the text, and a `ByteLevel` that splits after another step.
#[test]
fn the_byte_level_road_gives_the_crates_ids_for_any_text() {
    use proptest::prelude::*;
    const LLAMA3_SPLIT: &str = concat!(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}",
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    );
    let byte_level = |add_prefix_space: bool, use_regex: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true,
               "use_regex": use_regex})
    };
    let llama3 = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": false},
        byte_level(false, false),
    ]});
    let shapes = [
        ("gpt2", true, json!({})),
        ("llama3", true, json!({"pre_tokenizer": llama3})),
        (
            "qwen2",
            true,
            json!({"pre_tokenizer": llama3, "normalizer": {"type": "NFC"}}),
        ),
        (
            "prefix-space",
            false,
            json!({"pre_tokenizer": byte_level(true, true)}),
        ),
        (
            "digits-then-split",
            false,
            json!({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(false, true),
            ]}}),
        ),
    ];
    let piece = prop::sample::select(PIECES.to_vec());
    let text = prop_oneof![
        prop::collection::vec(piece, 0..60).prop_map(|p| p.concat()),
        any::<String>(),
    ];
    for (name, road, patch) in shapes {
        let [t, reference] = tiny_patched(name, &patch);
        assert_eq!(t.takes_the_byte_level_road(), road, "{name}");
        assert!(!reference.takes_the_byte_level_road());
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 200,
            ..ProptestConfig::default()
        });
        runner
            .run(&text, |text| {
                prop_assert_eq!(
                    t.prompt(&text).unwrap(),
                    reference.prompt(&text).unwrap(),
                    "{}",
                    name
                );
                let messages = json!([{"role": "user", "content": text}]);
                prop_assert_eq!(
                    t.chat(&messages).unwrap(),
                    reference.chat(&messages).unwrap(),
                    "{}",
                    name
                );
                Ok(())
            })
            .unwrap();
    }
}

/// A head stops within its budget of new text and estimates the rest from its own rate: a long
/// new message is routed on a few blocks, its length in tokens known to within a fifth.
#[test]
fn a_long_new_message_is_routed_on_a_head_with_its_length_estimated() {
    let t = tiny();
    let system = json!({"role": "system", "content": "You are a helpful assistant."});
    t.chat(&json!([system])).unwrap();
    let message = "Where does the prefix of this long document live? ".repeat(80);
    let messages = json!([system, {"role": "user", "content": message}]);
    let pending = t.prepare_chat(&messages).unwrap();
    assert!(pending.uncached_bytes() >= message.len());
    assert!(pending.fills_cache(), "a chat's new piece is worth caching");
    let whole = tiny().whole().chat(&messages).unwrap();
    let head = t.head(&pending, 256).unwrap();
    // The head reaches into the new message (an empty head would start the whole too): past
    // the cached system prompt, the template's header and at least a block of 16 new tokens.
    let before = t
        .chat(&json!([system, {"role": "user", "content": ""}]))
        .unwrap();
    assert!(
        head.ids.len() >= before.len() + 16,
        "{} of the head against {} before the message",
        head.ids.len(),
        before.len()
    );
    assert!(whole.starts_with(&head.ids));
    assert!(
        head.ids.len() < whole.len() / 4,
        "{} of {} tokens",
        head.ids.len(),
        whole.len()
    );
    let estimate = (head.ids.len() + head.rest_tokens) as f64;
    assert!(
        (estimate / whole.len() as f64 - 1.0).abs() < 0.2,
        "{estimate} estimated, {} in fact",
        whole.len()
    );
    // Finishing the same pending request caches the message for the next turn.
    let finished = t.finish(t.prepare_chat(&messages).unwrap()).unwrap();
    assert_eq!(finished, whole);
    assert!(t.prepare_chat(&messages).unwrap().uncached_bytes() < 64);
    // A completion's prompt caches nothing, so nothing is worth finishing after its head.
    assert!(!t.prepare_prompt(&message).fills_cache());
}
