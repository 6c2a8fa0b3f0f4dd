//! Engine behaviour in virtual time: prefix reuse, preemption, queueing, batching cost, abort.

use kvroute::sim::engine::{Engine, EngineRequest, Event};
use kvroute::sim::presets::{CostModel, EngineParams};
use kvroute::sim::replay::random_request;

fn params(blocks: usize, max_num_seqs: usize) -> EngineParams {
    EngineParams {
        model: "m".into(),
        max_model_len: 4096,
        num_gpu_blocks: blocks,
        block_size: 16,
        max_num_seqs,
        max_num_batched_tokens: 2048,
        cost: CostModel {
            step_base_ms: 10.0,
            prefill_ms_per_token: 0.1,
            decode_ms_per_seq: 0.2,
            kv_read_ms_per_1k_tokens: 0.1,
        },
    }
}

/// Steps until idle; returns (end time, events in order).
fn run(engine: &mut Engine, mut now: f64) -> (f64, Vec<(u64, Event)>) {
    let mut events = Vec::new();
    while !engine.is_idle() {
        let out = engine.step(now);
        now += out.duration;
        events.extend(out.events);
    }
    (now, events)
}

fn finished(events: &[(u64, Event)], id: u64) -> (usize, f64) {
    events
        .iter()
        .find_map(|(i, e)| match e {
            Event::Finished {
                cached_tokens,
                timings,
                ..
            } if *i == id => Some((*cached_tokens, timings.ttft)),
            _ => None,
        })
        .expect("request finished")
}

#[test]
fn a_shared_prefix_is_prefilled_once_and_counted_as_hits() {
    let mut e = Engine::new(params(1000, 16));
    let a = random_request(1, 600, 4);
    let mut b = random_request(2, 600, 4);
    b.prompt[..512].copy_from_slice(&a.prompt[..512]);
    // All but the last token cached: vLLM computes that one again and counts it as a hit too.
    let mut c = random_request(3, 513, 4);
    c.prompt.copy_from_slice(&a.prompt[..513]);
    let id = e.add(a, 0.0);
    let (t, ev) = run(&mut e, 0.0);
    assert_eq!(finished(&ev, id).0, 0);
    let prefill_first = e.counters.prefill_tokens_computed;
    let id = e.add(b, t);
    let (t, ev) = run(&mut e, t);
    let (cached, _) = finished(&ev, id);
    assert_eq!(cached, 512, "32 full blocks of 16 shared tokens");
    assert_eq!(
        e.counters.prefill_tokens_computed - prefill_first,
        600 - 512
    );
    assert_eq!(e.counters.prefix_hits, 512);
    assert_eq!(e.counters.prefix_queries, 1200);
    let c = e.add(c, t);
    let (_, ev) = run(&mut e, t);
    assert_eq!(finished(&ev, c).0, 512);
    let n = &e.counters;
    assert_eq!(
        (n.prompt_tokens, n.prompt_cached, n.prompt_recomputed),
        (1713, 1024, 1)
    );
}

/// Each block hashed with the token after it, as vLLM 0.33 hashes them with EAGLE-style
/// speculative decoding: a block is reused only by a prompt that goes on with that token.
#[test]
fn with_lookahead_hashes_a_block_is_reused_only_before_the_same_next_token() {
    let mut e = Engine::new(params(1000, 16));
    e.set_hash_lookahead(1);
    let a = random_request(1, 600, 4);
    // The first 32 blocks shared, then another token: the 32nd block's next token differs.
    let mut b = random_request(2, 600, 4);
    b.prompt[..512].copy_from_slice(&a.prompt[..512]);
    b.prompt[512] = a.prompt[512] ^ 1;
    // The first 520 tokens shared: the 33rd block differs, the 32nd goes on as `a` does.
    let mut c = random_request(3, 600, 4);
    c.prompt[..520].copy_from_slice(&a.prompt[..520]);
    c.prompt[520] = a.prompt[520] ^ 1;
    let id = e.add(a, 0.0);
    let (t, ev) = run(&mut e, 0.0);
    assert_eq!(finished(&ev, id).0, 0);
    let id = e.add(b, t);
    let (t, ev) = run(&mut e, t);
    assert_eq!(
        finished(&ev, id).0,
        496,
        "31 blocks: the 32nd went on otherwise"
    );
    let id = e.add(c, t);
    let (_, ev) = run(&mut e, t);
    assert_eq!(finished(&ev, id).0, 512);
}

#[test]
fn kv_exhaustion_preempts_the_youngest_and_everyone_still_finishes() {
    // 40 blocks = 640 tokens; four requests of 100 in + 100 out need 52 blocks at their peak.
    let mut e = Engine::new(params(40, 16));
    let ids: Vec<u64> = (0..4)
        .map(|i| e.add(random_request(i + 10, 100, 100), 0.0))
        .collect();
    let (_, ev) = run(&mut e, 0.0);
    assert!(e.counters.preemptions > 0);
    for id in ids {
        let tokens = ev
            .iter()
            .filter(|(i, e)| *i == id && matches!(e, Event::Token { .. }))
            .count();
        assert_eq!(tokens, 100, "request {id} got all its tokens");
    }
    assert_eq!(e.kv_usage(), 0.0, "every block released at the end");
}

#[test]
fn ttft_grows_with_the_queue_ahead() {
    // Two slots: request k waits for the (k/2) pairs before it.
    let mut e = Engine::new(params(1000, 2));
    let ids: Vec<u64> = (0..6)
        .map(|i| e.add(random_request(i + 20, 64, 32), 0.0))
        .collect();
    let (_, ev) = run(&mut e, 0.0);
    let ttft: Vec<f64> = ids.iter().map(|id| finished(&ev, *id).1).collect();
    assert!(ttft[2] > ttft[0] && ttft[4] > ttft[2], "{ttft:?}");
    assert!(ttft[4] > 2.0 * ttft[2] * 0.9, "{ttft:?}");
}

fn decode_rate(concurrency: usize) -> f64 {
    let mut e = Engine::new(params(4000, 256));
    for i in 0..concurrency {
        e.add(random_request(i as u64 + 100, 32, 200), 0.0);
    }
    let mut now = 0.0;
    // Past prefill, time 50 decode steps.
    while e.counters.generation_tokens < concurrency as u64 * 10 {
        now += e.step(now).duration;
    }
    let (t0, g0) = (now, e.counters.generation_tokens);
    for _ in 0..50 {
        now += e.step(now).duration;
    }
    let per_stream = (e.counters.generation_tokens - g0) as f64 / concurrency as f64;
    per_stream / (now - t0)
}

#[test]
fn per_stream_decode_rate_falls_as_concurrency_rises() {
    let (one, eight, sixty_four) = (decode_rate(1), decode_rate(8), decode_rate(64));
    assert!(
        one > eight && eight > sixty_four,
        "{one} {eight} {sixty_four}"
    );
    // ...while total throughput still rises (batching amortises the weight read).
    assert!(64.0 * sixty_four > 8.0 * eight && 8.0 * eight > one);
}

#[test]
fn an_aborted_request_stops_at_the_next_step_and_frees_its_blocks() {
    let mut e = Engine::new(params(1000, 16));
    let id = e.add(random_request(5, 300, 500), 0.0);
    let mut now = 0.0;
    for _ in 0..5 {
        now += e.step(now).duration;
    }
    assert!(e.kv_usage() > 0.0);
    let generated = e.counters.generation_tokens;
    assert!(e.abort(id));
    let out = e.step(now);
    assert!(out.events.is_empty(), "no token after the abort");
    assert_eq!(e.counters.generation_tokens, generated);
    assert_eq!(e.kv_usage(), 0.0);
    assert!(e.is_idle());
}

#[test]
fn a_prompt_is_counted_when_its_prefill_yields_a_token_as_vllm_counts_it() {
    // A 4,000-token prompt takes two chunked-prefill steps at 2,048 tokens a step. vLLM adds a
    // prompt to `vllm:prompt_tokens_total` with its first token, but its prefix-cache query when
    // it is scheduled; a request aborted mid-prefill is never counted as prompt tokens.
    let mut e = Engine::new(params(1000, 16));
    let aborted = e.add(random_request(7, 4000, 4), 0.0);
    let mut now = e.step(0.0).duration;
    assert_eq!(e.counters.prefix_queries, 4000, "queried when scheduled");
    assert_eq!(e.counters.prompt_tokens, 0, "no token yet, so not counted");
    assert!(e.abort(aborted));
    now += e.step(now).duration;
    assert_eq!(e.counters.prompt_tokens, 0);

    let id = e.add(random_request(8, 4000, 4), now);
    now += e.step(now).duration;
    assert_eq!(e.counters.prompt_tokens, 0, "still prefilling");
    let out = e.step(now);
    assert!(out.events.iter().any(|(i, _)| *i == id), "the first token");
    assert_eq!(e.counters.prompt_tokens, 4000);
    run(&mut e, now + out.duration);
    assert_eq!(e.counters.prompt_tokens, 4000, "counted once");
}

#[test]
fn a_request_kept_after_its_client_left_is_counted_as_waste() {
    let mut e = Engine::new(params(1000, 16));
    let id = e.add(random_request(6, 32, 20), 0.0);
    e.step(0.0);
    e.client_gone(id);
    run(&mut e, 1.0);
    assert_eq!(e.counters.generated_after_disconnect, 19);
}

#[test]
fn output_is_deterministic_for_a_seed_and_honours_stop_and_length() {
    let texts = |req: EngineRequest| {
        let mut e = Engine::new(params(1000, 4));
        e.add(req, 0.0);
        let (_, ev) = run(&mut e, 0.0);
        let mut text = String::new();
        let mut reason = None;
        for (_, e) in ev {
            match e {
                Event::Token { text: t } => text.push_str(&t),
                Event::Finished { reason: r, .. } => reason = Some(r.as_str()),
            }
        }
        (text, reason)
    };
    let (a, ra) = texts(random_request(9, 40, 30));
    let (b, _) = texts(random_request(9, 40, 30));
    assert_eq!(a, b);
    assert_eq!(ra, Some("length"));
    let word = a.split_inclusive(' ').nth(3).expect("several words");
    let (stopped, rs) = texts(EngineRequest {
        stop: vec![word.trim().to_string()],
        ..random_request(9, 40, 30)
    });
    assert_eq!(rs, Some("stop"));
    assert!(a.starts_with(&stopped) && stopped.len() < a.len());
}
