//! Nasty request bodies: a committed corpus through the real gateway, and generated bodies
//! through the routing key (proptest, bounded). Every one gets a clear answer, none a panic,
//! and nothing malformed reaches a worker.

mod common;

use std::sync::atomic::Ordering;

use common::{config_for, gateway, request, upstream};
use kvroute::{
    config::RoutingKeyConfig,
    routing_key::{extract, PromptField},
};
use proptest::prelude::*;

#[tokio::test]
async fn the_corpus_gets_clear_answers_and_malformed_bodies_never_reach_a_worker() {
    let up = upstream("w0", &[]).await;
    let gw = gateway(config_for(&[&up], "cache_aware")).await;
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/corpus");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let body = std::fs::read(&path).unwrap();
        let valid_json = serde_json::from_slice::<serde_json::Value>(&body).is_ok();
        for route in ["/v1/completions", "/v1/chat/completions", "/v1/responses"] {
            let before = up.requests.load(Ordering::SeqCst);
            let r = request(gw.addr, "POST", route, &body).await;
            assert!(
                matches!(r.status, 200 | 400),
                "{path:?} {route}: {}",
                r.status
            );
            if r.status == 400 {
                let e = r.json();
                assert_eq!(e["error"]["code"], 400, "{path:?}");
                assert!(e["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()));
                assert_eq!(
                    up.requests.load(Ordering::SeqCst),
                    before,
                    "{path:?} reached a worker"
                );
            }
            if !valid_json {
                assert_eq!(r.status, 400, "{path:?} is not JSON");
            }
        }
        seen += 1;
    }
    assert!(seen >= 20);
    // Still serving.
    assert_eq!(
        request(gw.addr, "POST", "/v1/completions", br#"{"prompt":"ok"}"#)
            .await
            .status,
        200
    );
}

/// JSON-ish text built from the pieces request bodies are made of.
fn jsonish() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("{".to_string()),
        Just("}".to_string()),
        Just("[".to_string()),
        Just("]".to_string()),
        Just(",".to_string()),
        Just(":".to_string()),
        Just("\"prompt\"".to_string()),
        Just("\"messages\"".to_string()),
        Just("\"input\"".to_string()),
        Just("\"instructions\"".to_string()),
        Just("\"role\"".to_string()),
        Just("\"content\"".to_string()),
        Just("\"type\"".to_string()),
        Just("\"text\"".to_string()),
        Just("null".to_string()),
        any::<u32>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        "\"[a-z\\\\u00e9]{0,8}\"".prop_map(|s| s),
    ];
    proptest::collection::vec(piece, 0..60).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn any_body_is_keyed_or_refused_with_400(body in jsonish(), bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let cfg = RoutingKeyConfig { block_bytes: 16, max_blocks: 8 };
        for input in [body.as_bytes(), &bytes] {
            for field in [PromptField::Prompt, PromptField::Messages, PromptField::Input] {
                match extract(input, field, &cfg) {
                    Ok(info) => {
                        prop_assert!(info.block_hashes.len() <= 8);
                        prop_assert_eq!(info.block_hashes.len(), info.block_ends.len());
                    }
                    Err(e) => prop_assert_eq!(e.status_and_type().0.as_u16(), 400),
                }
            }
        }
    }

    #[test]
    fn well_formed_chat_bodies_are_always_keyed(
        turns in proptest::collection::vec(("(system|user|assistant)", "[ -~]{0,300}"), 1..12),
    ) {
        let messages: Vec<_> = turns
            .iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect();
        let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
        let cfg = RoutingKeyConfig::default();
        let info = extract(body.as_bytes(), PromptField::Messages, &cfg).unwrap();
        // Each block ends after the one before it, and never past the prompt.
        prop_assert!(info.block_ends.windows(2).all(|w| w[0] < w[1]));
        prop_assert!(info.block_ends.last().is_none_or(|&e| u64::from(e) <= info.prompt_bytes));
    }
}
