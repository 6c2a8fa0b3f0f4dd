#!/usr/bin/env python3
"""The keep-alive race: requests lost when a worker closes an idle connection as kvroute reuses it.

    python3 benches/keepalive_race.py [--bin target/release/kvroute] [--requests 800] [--runs 2]
                                      [--keep-alive 0.05]

vLLM's HTTP server (uvicorn) closes a keep-alive connection idle for 5 s
(`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`). A request written to such a connection as the worker closes it
is lost after it was sent: the proxy cannot tell whether the worker began it, so it answers 502.
kvroute avoids the race by never sending on a connection that may have been idle for
`timeouts.worker_idle_seconds` (default 4 s, below vLLM's 5 s).

This script shows the race and the cure on loopback, at a time scale where it can be hit often: a
uvicorn worker whose keep-alive is `--keep-alive` seconds (default 50 ms), kvroute in front of it,
and one keep-alive client that sends a small completion request, waits a random gap of 0.9-1.1x
the worker's keep-alive, and repeats. Each run measures kvroute with its pool timeout above the
worker's keep-alive (60 s: kvroute before the fix) and below it (0.8x the worker's), in turn, and
counts the answers that were not 200.

Needs uvicorn (installs it with pip when missing). About 45 s per run with the defaults.
"""

import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

APP = r"""
import sys, uvicorn
BODY = (b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":'
        b'[{"index":0,"text":"ok","logprobs":null,"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}')
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": BODY})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]),
            timeout_keep_alive=float(sys.argv[2]), log_level="error")
"""

REQUEST = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1})


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port, path, deadline_s=20.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", path)
            c.getresponse().read()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing answered on 127.0.0.1:{port} within {deadline_s} s")


def one(bin_path, keep_alive, pool_idle, requests, seed):
    worker_port, gateway_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "kvroute.yaml")
        with open(cfg, "w") as f:
            f.write(
                f"listen: 127.0.0.1:{gateway_port}\n"
                f"workers:\n  - {{url: 'http://127.0.0.1:{worker_port}', name: w0}}\n"
                "policy: {kind: round_robin}\n"
                f"timeouts: {{worker_idle_seconds: {pool_idle}}}\n"
            )
        worker = subprocess.Popen([sys.executable, "-c", APP, str(worker_port), str(keep_alive)])
        gateway = subprocess.Popen(
            [bin_path, "serve", "--config", cfg],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_http(worker_port, "/")
            wait_http(gateway_port, "/health")
            rng = random.Random(seed)
            conn = http.client.HTTPConnection("127.0.0.1", gateway_port, timeout=10)
            failed = {}
            for _ in range(requests):
                conn.request("POST", "/v1/completions", REQUEST, {"content-type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    failed[resp.status] = failed.get(resp.status, 0) + 1
                time.sleep(rng.uniform(0.9 * keep_alive, 1.1 * keep_alive))
            return failed
        finally:
            for p in (gateway, worker):
                p.terminate()
                p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="target/release/kvroute")
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--keep-alive", type=float, default=0.05, help="the worker's, in seconds")
    args = ap.parse_args()
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "uvicorn"], check=True)
    settings = [("above the worker's (60 s)", 60.0), ("below the worker's (0.8x)", 0.8 * args.keep_alive)]
    print(f"worker keep-alive {args.keep_alive * 1000:.0f} ms, {args.requests} requests per cell, "
          "client gaps 0.9-1.1x the keep-alive")
    print("| run | kvroute pool timeout | requests not answered 200 |")
    print("|---|---|---|")
    for run in range(1, args.runs + 1):
        for label, idle in settings:
            failed = one(args.bin, args.keep_alive, idle, args.requests, seed=run)
            lost = sum(failed.values())
            detail = ", ".join(f"{n} x {s}" for s, n in sorted(failed.items()))
            print(f"| {run} | {label} | {lost} ({100 * lost / args.requests:.1f}%)"
                  f"{' ' + detail if detail else ''} |", flush=True)


if __name__ == "__main__":
    main()
