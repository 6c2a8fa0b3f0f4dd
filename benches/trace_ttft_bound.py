#!/usr/bin/env python3
"""A lower bound on a Mooncake-format trace's TTFT percentiles that no router can beat.

Each request is priced as its own prefill on an idle worker, with every block an earlier request
of the trace carried already cached (equal hash ids are equal 512-token blocks, and a prompt can
only reuse a cached prefix: its leading run of ids seen before). The prefill runs in chunks of
--chunk tokens, each a step of at least --step-ms, at --ms-per-token; the defaults are the
simulator's l4-qwen2.5-7b preset (src/sim/presets.rs). Only requests within the first --seconds of
the trace divided by --speedup are counted, as `kvroute bench compare --trace F --trace-speedup S
--duration D` counts them. No queueing and no eviction are modelled, so a measured TTFT
percentile below this bound would mean the bench is wrong, and a goal below it is unreachable.

    python3 benches/trace_ttft_bound.py sample.jsonl --speedup 3 --seconds 300
"""
import argparse
import json

BLOCK_TOKENS = 512


def percentile(values, p):
    v = sorted(values)
    return v[min(len(v) - 1, int(p * len(v)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--speedup", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=float("inf"))
    ap.add_argument("--ms-per-token", type=float, default=0.38)
    ap.add_argument("--step-ms", type=float, default=40.0)
    ap.add_argument("--chunk", type=int, default=2048)
    a = ap.parse_args()
    with open(a.trace) as f:
        reqs = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["timestamp"])
    seen, bounds = set(), []
    start = reqs[0]["timestamp"] if reqs else 0
    for r in reqs:
        ids = r["hash_ids"]
        reused = 0
        while reused < len(ids) and ids[reused] in seen:
            reused += 1
        seen.update(ids)
        if (r["timestamp"] - start) / a.speedup >= a.seconds * 1000:
            continue
        uncached = max(r["input_length"] - reused * BLOCK_TOKENS, 0)
        steps = -(-uncached // a.chunk)
        bounds.append(uncached * a.ms_per_token + steps * a.step_ms)
    if not bounds:
        raise SystemExit("no requests in the window")
    print(
        f"{len(bounds)} requests; TTFT lower bound ms: p50 {percentile(bounds, 0.5):.0f}, "
        f"p95 {percentile(bounds, 0.95):.0f}, p99 {percentile(bounds, 0.99):.0f}"
    )


if __name__ == "__main__":
    main()
