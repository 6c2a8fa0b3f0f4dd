#!/usr/bin/env python3
"""vllm-router's `kv_aware` policy, fed by the workers' KV events, as an external arm of
`kvroute bench compare`.

vllm-router (PyPI `vllm-router`, vllm-project/router; `kv_aware` is in 0.1.17) routes on vLLM's
KV cache events when it is told each worker's event endpoints and given the model's tokenizer.
This script asks every worker for its endpoints (`GET /kv_event_sources`, which vLLM 0.32 and
`kvroute sim --kv-events` serve), points the router at them, and hands it the tokenizer through
`VLLM_ROUTER_TOKENIZER`. The pool must publish events, so run it beside a `+events` arm, with
the workers tokenizing as the model does:

    kvroute bench compare --policies cache_aware,cache_aware+events \\
        --external 'vllm-router-kv=python3 benches/vllm_router_kv_aware.py {port} {workers_csv} MODEL TOKENIZER_JSON' \\
        --tokenizer TOKENIZER_JSON --tokenizer-config TOKENIZER_CONFIG ...

ROUTER (environment) names the vllm-router executable; `vllm-router` on the PATH by default.
"""
import json
import os
import sys
import time
import urllib.parse
import urllib.request


def endpoints(worker, deadline):
    """The worker's (publisher, replay) endpoints by rank, with its host for vLLM's wildcard."""
    host = urllib.parse.urlsplit(worker).hostname
    while True:
        try:
            with urllib.request.urlopen(worker + "/kv_event_sources", timeout=5) as r:
                listing = json.load(r)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                sys.exit(f"{worker}/kv_event_sources: {e}")
            time.sleep(0.2)
    if not listing:
        sys.exit(f"{worker} publishes no KV events (start the pool with them: a +events arm)")
    ranks = sorted(listing.items(), key=lambda kv: int(kv[0]))

    def local(endpoint):
        scheme, _, port = endpoint.rpartition(":")
        return f"tcp://{host}:{port}" if scheme.endswith("*") else endpoint

    pubs = [local(c["endpoint"]) for _, c in ranks]
    replays = [local(c["replay_endpoint"]) for _, c in ranks if c.get("replay_endpoint")]
    return pubs, replays if len(replays) == len(pubs) else []


def main():
    if len(sys.argv) != 5:
        sys.exit(f"usage: {sys.argv[0]} PORT WORKERS_CSV MODEL TOKENIZER_JSON")
    port, workers_csv, model, tokenizer = sys.argv[1:]
    workers = [w for w in workers_csv.split(",") if w]
    deadline = time.monotonic() + 30
    args = [
        os.environ.get("ROUTER", "vllm-router"),
        "--host", "127.0.0.1",
        "--port", port,
        "--worker-urls", *workers,
        "--policy", "kv_aware",
        "--kv-event-block-size", os.environ.get("BLOCK_SIZE", "16"),
        "--kv-event-model", model,
        "--log-level", "warning",
    ]
    for w in workers:
        pubs, replays = endpoints(w, deadline)
        args += ["--kv-event-source", f"{w}={','.join(pubs)}"]
        if replays:
            args += ["--kv-event-replay-source", f"{w}={','.join(replays)}"]
    os.environ["VLLM_ROUTER_TOKENIZER"] = tokenizer
    os.execvp(args[0], args)


if __name__ == "__main__":
    main()
