//! Fidelity: presets replay published vLLM measurements with the same workload and land within a
//! stated tolerance, with the same curve shape.
//!
//! The engine runs in virtual time (no wall clock), so each table takes milliseconds.

use kvroute::sim::engine::EngineRequest;
use kvroute::sim::presets;
use kvroute::sim::replay::{closed_loop, random_request, RunSummary};

fn preset(name: &str) -> kvroute::sim::presets::EngineParams {
    (presets::find(name).expect("preset exists").params)()
}

fn within(got: f64, want: f64, tol: f64) -> bool {
    (got - want).abs() <= tol * want
}

/// RTX 4090, Mistral-7B-Instruct, vLLM, random prompts 256 in / 128 out, 300 prompts, unlimited
/// rate, max concurrency C (figures from issue 3's calibration table): (C, req/s, output tok/s,
/// TTFT mean ms, TTFT p99 ms). vLLM's benchmark does not ignore EOS by default, so outputs stop
/// early (210 tok/s at 2.09 req/s is ~100 tokens a request); the replay does the same.
const RTX4090: &[(usize, f64, f64, f64, f64)] = &[
    (4, 2.09, 210.0, 63.0, 157.0),
    (8, 3.78, 377.0, 79.0, 268.0),
    (16, 6.44, 644.0, 155.0, 503.0),
    (32, 9.73, 975.0, 362.0, 938.0),
    (48, 11.87, 1190.0, 667.0, 1483.0),
];

fn rtx4090_at(c: usize) -> RunSummary {
    let p = preset("rtx4090-mistral-7b");
    closed_loop(&p, c, 300, |i| EngineRequest {
        ignore_eos: false,
        ..random_request(i as u64 + 1, 256, 128)
    })
}

#[test]
fn rtx4090_throughput_tracks_the_published_sweep_within_15_percent() {
    for &(c, req_s, tok_s, _, _) in RTX4090 {
        let s = rtx4090_at(c);
        assert!(
            within(s.req_per_s, req_s, 0.15),
            "C={c}: {:.2} req/s vs {req_s}",
            s.req_per_s
        );
        assert!(
            within(s.output_tok_per_s, tok_s, 0.15),
            "C={c}: {:.0} tok/s vs {tok_s}",
            s.output_tok_per_s
        );
    }
}

#[test]
fn rtx4090_curve_rises_then_flattens_and_ttft_p99_climbs_past_the_knee() {
    let runs: Vec<RunSummary> = RTX4090.iter().map(|r| rtx4090_at(r.0)).collect();
    // Throughput rises at every step but the last doubling-ish step gains far less per request
    // slot than the first: 4→8 adds >60%, 32→48 adds <25% (published: +81%, +22%).
    for w in runs.windows(2) {
        assert!(w[1].req_per_s > w[0].req_per_s);
    }
    assert!(runs[1].req_per_s / runs[0].req_per_s > 1.6);
    assert!(runs[4].req_per_s / runs[3].req_per_s < 1.25);
    // TTFT p99 grows several-fold from C=4 to C=48 (published: 9.4x).
    assert!(runs[4].ttft_p99 / runs[0].ttft_p99 > 5.0);
    // At low concurrency the mean TTFT is the prefill of one prompt: within 25% of 63 and 79 ms.
    for (r, &(c, _, _, ttft, _)) in runs.iter().zip(RTX4090).take(2) {
        assert!(
            within(r.ttft_mean * 1e3, ttft, 0.25),
            "C={c}: TTFT mean {:.0} ms vs {ttft}",
            r.ttft_mean * 1e3
        );
    }
    // Known gap, stated rather than tuned away: past the knee the simulated mean TTFT is about
    // half the published one (vLLM's API server adds CPU time per stream that the cost model
    // does not have), so only the direction is asserted there.
    assert!(runs[4].ttft_mean > 3.0 * runs[0].ttft_mean);
}

/// One worker's share of a 2-worker pool behind prefix-aware routing: 4 of the 8 prefixes.
fn shared(i: usize) -> EngineRequest {
    let unique = random_request(1_000_000 + i as u64, 128, 128);
    let head = random_request(7 + (i % 4) as u64, 384, 0).prompt;
    EngineRequest {
        prompt: head.into_iter().chain(unique.prompt).collect(),
        ..unique
    }
}

/// Two L4s (Qwen2.5-7B BF16, one worker each), 512 in / 128 out, prefix-aware routing. Cold sweep
/// on 8 prefixes × 384 shared + 128 unique: C=4 0.74 req/s, C=16 2.55, C=64 7.66, C=128 11.06;
/// sustained C=128: 13.0 req/s shared vs 6.7 req/s fully random. Each worker takes half the
/// clients, so the pool's rate is twice one worker's.
#[test]
fn l4_pool_lands_near_the_published_shared_and_random_rates() {
    let p = preset("l4-qwen2.5-7b");
    for (c, want) in [(4usize, 0.74), (16, 2.55), (64, 7.66)] {
        let s = closed_loop(&p, c / 2, 20 * c, shared);
        let got = 2.0 * s.req_per_s;
        assert!(within(got, want, 0.20), "C={c}: {got:.2} req/s vs {want}");
    }
    let s = closed_loop(&p, 64, 2000, shared);
    let r = closed_loop(&p, 64, 2000, |i| random_request(i as u64 + 1, 512, 128));
    let (shared_rate, random_rate) = (2.0 * s.req_per_s, 2.0 * r.req_per_s);
    assert!(
        shared_rate > 11.06 * 0.9 && shared_rate < 13.0 * 1.1,
        "{shared_rate:.2}"
    );
    assert!(within(random_rate, 6.7, 0.20), "{random_rate:.2}");
    // The shape the product rests on: sharing a prefix nearly doubles the rate (published 1.94x).
    let ratio = shared_rate / random_rate;
    assert!((1.6..=2.3).contains(&ratio), "{ratio:.2}");
    assert!(s.prefix_hit_rate > 0.6 && r.prefix_hit_rate < 0.05);
}
