//! Workers that publish KV events: what their events say beats what the index knows.

use super::*;

/// Two replicas fed the same events choose alike even when one has routed part of the
/// prompt itself and the other has not: the home of what no worker holds comes from the
/// events, not from each replica's own index.
#[test]
fn replicas_fed_the_same_events_pick_the_same_home() {
    let ws = workers_with_events(4);
    let (a, b) = (policy(), policy());
    for c in 0..64u64 {
        let mut req = convo(c, 1, 3);
        req.tokens = Some((0..40).map(|t| (c * 1000 + t) as u32).collect());
        // Replica a once sent the first two blocks of this prompt to some worker.
        a.index
            .insert(&req.block_hashes[..2], ws[c as usize % 4].id_hash);
        let (sa, sb) = (a.peek(&ws, &req).unwrap(), b.peek(&ws, &req).unwrap());
        assert_eq!(sa.index, sb.index, "conversation {c}");
    }
}

#[test]
fn on_events_questions_under_a_prefix_every_worker_holds_spread_by_pending_prefill() {
    // Every worker's events hold the same 32-token system prompt. A new question under it:
    // every worker would prefill the same 8 tokens, and wherever it goes, the events tell
    // every replica so. It goes where no prefill waits, as with one gateway, whatever the
    // polled load says of other replicas.
    let system: Vec<u32> = (0..32).collect();
    let ws = workers_storing(4, (100..108).collect(), system.clone());
    let question = |c: u32| {
        let mut r = convo(u64::from(c), 2, 1);
        let tokens: Vec<u32> = system
            .iter()
            .copied()
            .chain(1000 * c..1000 * c + 8)
            .collect();
        r.tokens = Some(tokens.into());
        r
    };
    let p = policy();
    let _mine = another_replica_as_busy(&ws);
    let home = p.peek(&ws, &question(1)).unwrap().index;
    let held = hold(&ws[home], 8, 40);
    assert_ne!(p.peek(&ws, &question(1)).unwrap().index, home);
    drop(held);
    let together = arrive_together(&p, &ws, (10..18).map(question), (8, 40));
    assert_eq!(together, [2, 2, 2, 2]);
}

#[test]
fn a_worker_whose_events_hold_the_prompt_wins_over_what_the_index_knows() {
    use crate::kv_events::{Feed, KvEvent};
    let tokens: Vec<u32> = (0..40).collect();
    let metrics = crate::metrics::Metrics::new();
    let mut ws = Vec::new();
    for i in 0..3 {
        let cfg = crate::config::WorkerConfig::from_url(format!("http://127.0.0.1:{}", 11000 + i));
        let mut w = Worker::new(&cfg, &metrics).unwrap();
        let feed = Feed::new(1000);
        if i == 2 {
            // Worker 2 stored the first 8 blocks of 4 tokens (someone else's traffic).
            feed.blocks().apply(&KvEvent::BlockStored {
                block_hashes: (100..108).collect(),
                parent_block_hash: None,
                token_ids: tokens[..32].to_vec(),
                block_size: 4,
                lora_id: None,
                lora_name: None,
                medium: None,
                group: Default::default(),
                block_keys: Vec::new(),
                lookahead: Vec::new(),
            });
        } else {
            feed.blocks().apply(&KvEvent::BlockStored {
                block_hashes: vec![7],
                parent_block_hash: None,
                token_ids: vec![9, 9, 9, 9],
                block_size: 4,
                lora_id: None,
                lora_name: None,
                medium: None,
                group: Default::default(),
                block_keys: Vec::new(),
                lookahead: Vec::new(),
            });
        }
        w.events = Some(Arc::new(feed));
        ws.push(Arc::new(w));
    }
    let p = CacheAware::new(CacheAwareParams::default());
    // The index was told worker 0 holds this routing key; the events say worker 2 does.
    let mut req = convo(1, 2, 2);
    p.index.insert(&req.block_hashes, ws[0].id_hash);
    req.tokens = Some(tokens.clone().into());
    let s = pick(&p, &ws, &req);
    assert_eq!(s.index, 2);
    assert_eq!(s.outcome, Outcome::ExactMatch);
    let predicted = s.prediction.unwrap();
    assert_eq!(predicted.cached_tokens, 32);
    assert_eq!(predicted.prompt_tokens, 40);
    // Without token ids the events cannot be used: the index's guess stands.
    let fresh = CacheAware::new(CacheAwareParams::default());
    fresh.index.insert(&req.block_hashes, ws[0].id_hash);
    req.tokens = None;
    let s = pick(&fresh, &ws, &req);
    assert_eq!((s.index, s.outcome), (0, Outcome::LongestMatch));
}
