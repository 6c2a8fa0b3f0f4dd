//! Criterion benches for the per-request hot path: routing-key extraction and policy selection.
//!
//! `cargo bench --bench hot_path` measures; `cargo bench --bench hot_path -- --test` (CI) runs
//! each once to prove they still work.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute::config::{PolicyConfig, PrefixParams, RoutingKeyConfig, WorkerConfig};
use kvroute::metrics::Metrics;
use kvroute::policy;
use kvroute::routing_key::{extract, PromptField};
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
    g.finish();
}

fn policies(c: &mut Criterion) {
    let metrics = Metrics::new();
    let body = chat_body(1024);
    let info = extract(&body, PromptField::Messages, &RoutingKeyConfig::default()).expect("valid");
    let mut g = c.benchmark_group("select");
    for n in [8usize, 64, 1024] {
        let workers: Vec<Arc<Worker>> = (0..n)
            .map(|i| {
                let cfg =
                    WorkerConfig::from_url(format!("http://10.0.{}.{}:8000", i / 250, i % 250));
                Arc::new(Worker::new(&cfg, &metrics).expect("valid url"))
            })
            .collect();
        // Some load, so bounded-load and least-conn do real comparisons.
        let _guards: Vec<_> = workers.iter().step_by(3).map(|w| w.acquire()).collect();
        for cfg in [
            PolicyConfig::RoundRobin,
            PolicyConfig::LeastConn,
            PolicyConfig::Prefix(PrefixParams::default()),
        ] {
            let p = policy::build(&cfg);
            g.bench_with_input(BenchmarkId::new(p.name(), n), &workers, |b, w| {
                b.iter(|| p.select(w, &info).expect("a worker"))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, routing_key, policies);
criterion_main!(benches);
