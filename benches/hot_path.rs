//! Criterion benches for the per-request hot path: routing-key extraction, policy selection, and
//! tokenizing a request to look it up in a worker's event-fed block set.
//!
//! `cargo bench --bench hot_path` measures; `cargo bench --bench hot_path -- --test` (CI) runs
//! each once to prove they still work. `KVROUTE_BENCH_COUNT=<bench name>:<n>` runs one of the
//! 1,024-worker `cache_aware` cases exactly `n` times instead, for callgrind (see [`decision`]).

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute::config::{
    CacheAwareParams, PolicyConfig, PrefixParams, RoutingKeyConfig, WorkerConfig,
};
use kvroute::load::Polled;
use kvroute::metrics::Metrics;
use kvroute::policy;
use kvroute::routing_key::{extract, PromptField, RequestInfo};
use kvroute::workers::Worker;

fn chat_body(bytes: usize) -> Vec<u8> {
    let system = "You are a careful assistant. ".repeat(bytes / 29 + 1);
    serde_json::to_vec(&serde_json::json!({
        "model": "qwen",
        "stream": true,
        "messages": [
            {"role": "system", "content": &system[..bytes]},
            {"role": "user", "content": "What is the capital of France?"}
        ]
    }))
    .expect("static body")
}

fn routing_key(c: &mut Criterion) {
    let cfg = RoutingKeyConfig::default();
    let mut g = c.benchmark_group("routing_key");
    for size in [1024usize, 32 * 1024] {
        let body = chat_body(size);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_with_input(BenchmarkId::new("chat", size), &body, |b, body| {
            b.iter(|| extract(body, PromptField::Messages, &cfg).expect("valid body"))
        });
    }
    // The worst body for a parser: 8 MiB of one-token batches, `{"prompt": [[1],[1],…]}`.
    let mut tokens = String::from(r#"{"prompt":[[1]"#);
    while tokens.len() < (8 << 20) - 8 {
        tokens.push_str(",[1]");
    }
    tokens.push_str("]}");
    g.throughput(Throughput::Bytes(tokens.len() as u64));
    g.sample_size(10);
    g.bench_function("token_batches_8MiB", |b| {
        b.iter(|| extract(tokens.as_bytes(), PromptField::Prompt, &cfg).expect("valid body"))
    });
    g.finish();
}

fn pool(n: usize, metrics: &Metrics) -> Vec<Arc<Worker>> {
    (0..n)
        .map(|i| {
            let cfg = WorkerConfig::from_url(format!("http://10.0.{}.{}:8000", i / 250, i % 250));
            let w = Worker::new(&cfg, metrics).expect("valid url");
            // As a vLLM worker shows once polled: a KV cache (a simulated L4's 5,400 blocks of 16
            // tokens), so each decision dates its write on the chosen worker's KV clock and the
            // index walk checks its holders' clocks (`evict_by_capacity`).
            // `KVROUTE_BENCH_KV_CAPACITY=0` leaves it unknown, as before the first poll.
            w.kv.store(Some(&Polled {
                kv_capacity: kv_capacity(),
                ..Polled::default()
            }));
            // As its streams show a worker's steps (`step_phase`): 40 ms plus 0.4 ms per prefill
            // token, fitted, so that pricing a worker reads its step clock.
            // `KVROUTE_BENCH_STEPS=0` leaves the steps untimed.
            if timed_steps() {
                let prefill = |k: u64| (k * 37) % 5 * 128;
                let total: u64 = (0..32).map(|k| 40_000 + 400 * prefill(k)).sum();
                let mut t = kvroute::load::now_us() - total - (i as u64 * 7_919) % 40_000;
                for k in 0..32 {
                    t += 40_000 + 400 * prefill(k);
                    w.steps.frame(t, prefill(k), || 0);
                }
            }
            Arc::new(w)
        })
        .collect()
}

/// The KV capacity the pool's workers show, in tokens: `KVROUTE_BENCH_KV_CAPACITY`, or 86,400.
fn kv_capacity() -> f64 {
    std::env::var("KVROUTE_BENCH_KV_CAPACITY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(86_400.0)
}

/// Whether the pool's workers have timed steps: unless `KVROUTE_BENCH_STEPS=0`.
fn timed_steps() -> bool {
    std::env::var("KVROUTE_BENCH_STEPS").map_or(true, |v| v != "0")
}

/// Pseudo-random block hashes from `seed` (xorshift).
fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// Times `decide` as criterion's bench `name`, or, with `KVROUTE_BENCH_COUNT=<name>:<n>` set, runs
/// it exactly `n` times in [`counted`] instead, for an instruction count that the machine's noise
/// does not move: `valgrind --tool=callgrind --toggle-collect='*counted*'`, then the collected
/// total over `n`.
fn decision<R>(c: &mut Criterion, name: &str, mut decide: impl FnMut() -> R) {
    match std::env::var("KVROUTE_BENCH_COUNT") {
        Ok(v) => {
            if let Some(n) = v.strip_prefix(name).and_then(|n| n.strip_prefix(':')) {
                counted(
                    n.parse().expect("KVROUTE_BENCH_COUNT=<bench>:<n>"),
                    &mut decide,
                );
            }
        }
        Err(_) => {
            c.bench_function(name, |b| b.iter(&mut decide));
        }
    }
}

#[inline(never)]
fn counted<R>(n: usize, decide: &mut impl FnMut() -> R) {
    for _ in 0..n {
        std::hint::black_box(decide());
    }
}

/// Routes 12,500 unrelated 8-block prompts through `p`: 100k blocks in its index.
fn index_100k_blocks(
    p: &dyn policy::Policy,
    workers: &[Arc<Worker>],
    next: &mut impl FnMut() -> u64,
) {
    for _ in 0..12_500 {
        let hashes: Vec<u64> = (0..8).map(|_| next()).collect();
        p.select(workers, &RequestInfo::keyed(hashes, 256));
    }
}

/// `cache_aware` at 1,024 workers with 100k blocks in its index: one decision (index walk, cost
/// of every worker, index write) for a 32-block conversation whose first 24 blocks (a 16-block
/// system prompt and its earlier turn) are known on one worker (all 32 from the second
/// iteration on, as each decision writes them). The eight conversations placed
/// under the system prompt all go to that worker: with a third of the workers at one request in
/// flight, no queue outweighs a copy. So the system prompt is hot (every recent request went
/// through it) but one worker holds it, and the pool is too idle (mean in flight 0.33) for the
/// idle workers' credit: the pass prices every worker without it.
fn cache_aware_at_scale(c: &mut Criterion) {
    let metrics = Metrics::new();
    let workers = pool(1024, &metrics);
    let _guards: Vec<_> = workers.iter().step_by(3).map(|w| w.acquire()).collect();
    let p = policy::build(&PolicyConfig::CacheAware(CacheAwareParams::default()));
    let mut next = xorshift(0x2545_f491_4f6c_dd1d);
    index_100k_blocks(p.as_ref(), &workers, &mut next);
    let system: Vec<u64> = (0..16).map(|_| next()).collect();
    for _ in 0..8 {
        let mut h = system.clone();
        h.extend((0..8).map(|_| next()));
        p.select(&workers, &RequestInfo::keyed(h, 256));
    }
    let mut convo = system.clone();
    convo.extend((0..8).map(|_| next()));
    p.select(&workers, &RequestInfo::keyed(convo.clone(), 256));
    convo.extend((0..8).map(|_| next()));
    let info = RequestInfo::keyed(convo, 256);
    let stats = p.index_stats().expect("cache_aware keeps an index");
    assert!(stats.blocks >= 100_000, "{stats:?}");
    decision(c, "select/cache_aware_1024_workers_100k_blocks", || {
        p.select(&workers, &info).expect("a worker")
    });
    // A new question under the system prompt, which one worker holds. Timed with `peek`, the
    // decision without its index write: written, the question itself would be known on one
    // worker from the second iteration on.
    let mut question = system;
    question.extend((0..8).map(|_| next()));
    let question = RequestInfo::keyed(question, 256);
    decision(
        c,
        "select/cache_aware_1024_workers_question_under_hot_prefix",
        || p.peek(&workers, &question).expect("a worker"),
    );

    // A second system prompt, copied to as many workers as a block can list: each conversation
    // placed under it finds its holders' queues (1,000 requests each while it is placed) worth
    // more than a copy. A question under it is known no further than a prefix most workers are
    // presumed to hold, so `hot_pending_weight` applies and the pass prices every worker as
    // holding the prefix.
    let system: Vec<u64> = (0..16).map(|_| next()).collect();
    let mut holders: Vec<usize> = Vec::new();
    let mut crowd = Vec::new();
    for _ in 0..64 {
        let mut h = system.clone();
        h.extend((0..8).map(|_| next()));
        let s = p
            .select(&workers, &RequestInfo::keyed(h, 256))
            .expect("a worker");
        if !holders.contains(&s.index) {
            holders.push(s.index);
        }
        if holders.len() == kvroute::index::HOLDERS {
            break;
        }
        crowd.extend((0..1000).map(|_| workers[s.index].acquire()));
    }
    drop(crowd);
    assert_eq!(holders.len(), kvroute::index::HOLDERS, "{holders:?}");
    let mut question = system;
    question.extend((0..8).map(|_| next()));
    let question = RequestInfo::keyed(question, 256);
    // Whichever worker it goes to is priced as holding the 16 blocks.
    let to = p.peek(&workers, &question).expect("a worker");
    assert_eq!(to.prediction.map(|p| p.matched_blocks), Some(16), "{to:?}");
    decision(
        c,
        "select/cache_aware_1024_workers_question_under_prefix_on_full_holder_list",
        || p.peek(&workers, &question).expect("a worker"),
    );
}

/// `cache_aware` at 1,024 workers in a busy pool: two workers in three have four requests in
/// flight (a mean of 2.7), the rest none, and a system prompt that one worker holds is hot, so
/// the pass credits each idle worker for a copy (`amortize_hot_copies`; the holder has 64 in
/// flight). Timed: a new question under it (with `peek`, as above) and a conversation's next
/// turn, with 100k blocks indexed.
fn cache_aware_busy_pool(c: &mut Criterion) {
    let metrics = Metrics::new();
    let workers = pool(1024, &metrics);
    let _guards: Vec<_> = workers
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 3 != 0)
        .flat_map(|(_, w)| (0..4).map(|_| w.acquire()))
        .collect();
    let p = policy::build(&PolicyConfig::CacheAware(CacheAwareParams::default()));
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
    index_100k_blocks(p.as_ref(), &workers, &mut next);
    let system: Vec<u64> = (0..16).map(|_| next()).collect();
    let mut convo = system.clone();
    convo.extend((0..8).map(|_| next()));
    let first = p.select(&workers, &RequestInfo::keyed(convo.clone(), 256));
    convo.extend((0..8).map(|_| next()));
    let turn = RequestInfo::keyed(convo, 256);
    let mut question = system;
    question.push(next());
    let question = RequestInfo::keyed(question, 256);
    // The holder busier than its credit as the question's home (a one-block question: 96
    // tokens). The idle credit is what this bench is for: the question goes to an idle worker.
    let holder = first.expect("a worker").index;
    let _busy: Vec<_> = (0..64).map(|_| workers[holder].acquire()).collect();
    let to = p.peek(&workers, &question).expect("a worker");
    assert!(to.index != holder && to.index % 3 == 0, "{to:?}");
    decision(
        c,
        "select/cache_aware_1024_workers_busy_question_under_hot_prefix",
        || p.peek(&workers, &question).expect("a worker"),
    );
    decision(c, "select/cache_aware_1024_workers_busy_next_turn", || {
        p.select(&workers, &turn).expect("a worker")
    });
}

fn policies(c: &mut Criterion) {
    let metrics = Metrics::new();
    let body = chat_body(1024);
    let info = extract(&body, PromptField::Messages, &RoutingKeyConfig::default()).expect("valid");
    let mut g = c.benchmark_group("select");
    for n in [8usize, 64, 1024] {
        let workers = pool(n, &metrics);
        // Some load, so bounded-load and least-conn do real comparisons.
        let _guards: Vec<_> = workers.iter().step_by(3).map(|w| w.acquire()).collect();
        for cfg in [
            PolicyConfig::RoundRobin,
            PolicyConfig::LeastConn,
            PolicyConfig::Prefix(PrefixParams::default()),
            PolicyConfig::CacheAware(CacheAwareParams::default()),
        ] {
            let p = policy::build(&cfg);
            g.bench_with_input(BenchmarkId::new(p.name(), n), &workers, |b, w| {
                b.iter(|| p.select(w, &info).expect("a worker"))
            });
        }
    }
    g.finish();
}

/// Tokenizing a chat request as the worker does and looking its blocks up in a worker's
/// event-fed block set (16-token blocks, 100k blocks held), at 1, 8 and 32 KB of system prompt.
/// The tokenizer is `KVROUTE_BENCH_TOKENIZER` (e.g. the CPU vLLM pool's Llama 3
/// `tokenizer.json`) or, by default, the small committed one, which understates a 128k-token
/// vocabulary's cost.
fn tokenize_and_look_up(c: &mut Criterion) {
    use kvroute::kv_events::{KvEvent, WorkerBlocks};
    use kvroute::tokenize::{block_chain, ModelTokenizer};
    let root = env!("CARGO_MANIFEST_DIR");
    let json = std::env::var("KVROUTE_BENCH_TOKENIZER")
        .unwrap_or_else(|_| format!("{root}/tests/tokenize/tiny-tokenizer.json"));
    let config = format!("{root}/tests/vllm/model/tokenizer_config.json");
    let t = ModelTokenizer::load(json.as_ref(), Some(config.as_ref())).expect("tokenizer loads");
    assert!(t.encodes_heads(), "heads pass the load-time check");
    let mut blocks = WorkerBlocks::new(1 << 20);
    for i in 0..100_000u32 {
        blocks.apply(&KvEvent::BlockStored {
            block_hashes: vec![u64::from(i)],
            parent_block_hash: None,
            token_ids: vec![i; 16],
            block_size: 16,
            lora_id: None,
            lora_name: None,
            medium: None,
            group: Default::default(),
            block_keys: Vec::new(),
            lookahead: Vec::new(),
        });
    }
    let mut g = c.benchmark_group("tokenize_and_look_up");
    for size in [1024usize, 8 * 1024, 32 * 1024] {
        let body: serde_json::Value = serde_json::from_slice(&chat_body(size)).expect("json");
        let system = body["messages"][0].clone();
        g.throughput(Throughput::Bytes(size as u64));
        // A conversation's next request: the system prompt seen before, a new user message.
        let mut n = 0u64;
        g.bench_function(BenchmarkId::new("warm", size), |b| {
            b.iter(|| {
                n += 1;
                let m = serde_json::json!([system, {"role": "user", "content": format!("question {n}: what is the capital of France?")}]);
                let tokens = t.chat(&m).expect("renders");
                blocks.prefix_depth(&block_chain(&tokens, 16))
            })
        });
        // Nothing seen before, as the gateway routes it: the template rendered and the head of
        // the new text encoded, which is all routing needs when no worker holds its first
        // blocks (the rest is encoded after, off the request's path). A new system prompt each
        // time, so nothing comes from the piece cache.
        let mut n = 0u64;
        g.bench_function(BenchmarkId::new("cold_head", size), |b| {
            b.iter(|| {
                n += 1;
                let mut m = body["messages"].clone();
                let content = format!("{n} {}", m[0]["content"].as_str().expect("text"));
                m[0]["content"] = serde_json::Value::String(content);
                let pending = t.prepare_chat(&m).expect("renders");
                let head = t
                    .head(&pending, kvroute::tokenize::HEAD_BYTES)
                    .expect("encodes");
                blocks.prefix_depth(&block_chain(&head.ids, 16))
            })
        });
        // Nothing seen before, encoded whole (a tokenizer whose heads fail the load-time check).
        let text = t.render_chat(&body["messages"]).expect("renders");
        g.bench_function(BenchmarkId::new("cold", size), |b| {
            b.iter(|| {
                let tokens = t.prompt(&text).expect("encodes");
                blocks.prefix_depth(&block_chain(&tokens, 16))
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    routing_key,
    policies,
    cache_aware_at_scale,
    cache_aware_busy_pool,
    tokenize_and_look_up
);
criterion_main!(benches);
