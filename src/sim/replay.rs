//! Drives an engine in virtual time with a closed-loop client, as `vllm bench serve
//! --max-concurrency C --request-rate inf` does: C requests in flight, the next one sent the moment
//! one finishes. No wall clock is involved, so a five-minute GPU run replays in milliseconds; the
//! fidelity tests and `sim --list-presets` calibration use it.

use super::engine::{Engine, EngineRequest, Event};
use super::presets::EngineParams;

/// What a finished run measured, in modelled seconds.
#[derive(Clone, Debug, Default)]
pub struct RunSummary {
    pub requests: usize,
    pub duration: f64,
    pub req_per_s: f64,
    pub output_tok_per_s: f64,
    pub ttft_mean: f64,
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    /// Mean time per output token after the first, over requests.
    pub tpot_mean: f64,
    pub preemptions: u64,
    pub prefix_hit_rate: f64,
}

/// Runs `requests` through `params` at `concurrency`; `make(i)` builds request i.
pub fn closed_loop(
    params: &EngineParams,
    concurrency: usize,
    requests: usize,
    mut make: impl FnMut(usize) -> EngineRequest,
) -> RunSummary {
    let mut engine = Engine::new(params.clone());
    let mut now = 0.0;
    let mut sent = 0;
    let mut ttfts = Vec::with_capacity(requests);
    let mut tpots = Vec::with_capacity(requests);
    let mut output_tokens = 0usize;
    while sent < concurrency.min(requests) {
        engine.add(make(sent), now);
        sent += 1;
    }
    while !engine.is_idle() {
        let out = engine.step(now);
        now += out.duration;
        for (_, event) in out.events {
            if let Event::Finished {
                completion_tokens,
                timings,
                ..
            } = event
            {
                ttfts.push(timings.ttft);
                output_tokens += completion_tokens;
                if completion_tokens > 1 {
                    tpots.push((timings.e2e - timings.ttft) / (completion_tokens - 1) as f64);
                }
                if sent < requests {
                    engine.add(make(sent), now);
                    sent += 1;
                }
            }
        }
    }
    let c = &engine.counters;
    let n = ttfts.len();
    RunSummary {
        requests: n,
        duration: now,
        req_per_s: n as f64 / now,
        output_tok_per_s: output_tokens as f64 / now,
        ttft_mean: mean(&ttfts),
        ttft_p50: percentile(&mut ttfts, 50.0),
        ttft_p99: percentile(&mut ttfts, 99.0),
        tpot_mean: mean(&tpots),
        preemptions: c.preemptions,
        prefix_hit_rate: if c.prefix_queries == 0 {
            0.0
        } else {
            c.prefix_hits as f64 / c.prefix_queries as f64
        },
    }
}

/// A request of `input` random tokens and exactly `output` output tokens (`ignore_eos`), as the
/// `random` dataset of vLLM's benchmark sends.
pub fn random_request(seed: u64, input: usize, output: usize) -> EngineRequest {
    let mut x = seed;
    let prompt = (0..input)
        .map(|_| {
            x = super::engine::splitmix(x);
            1000 + (x % 30000) as u32
        })
        .collect();
    EngineRequest {
        prompt,
        max_tokens: output,
        min_tokens: 0,
        ignore_eos: true,
        stop: Vec::new(),
        seed,
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Nearest-rank percentile.
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}
