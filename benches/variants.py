#!/usr/bin/env python3
"""Several proxies side by side on the non-streaming load of overhead.py: kvroute builds, each
with a config of its own, and nginx with a given number of worker processes, in interleaved
rounds against one fast upstream. For questions overhead.py's fixed targets cannot ask, such as
what a second event loop costs per request, or what a routing policy costs against another.

    python3 benches/variants.py --rounds 6 \\
        one=target/release/kvroute:one-loop.yaml two=target/release/kvroute \\
        nginx1=nginx:1 nginx2=nginx:2

Each variant is NAME=BINARY, NAME=BINARY:CONFIG (passed as `--config`), or NAME=nginx:WORKERS.
Prints, per variant, the medians over the rounds of req/s, p99, user and system CPU µs per
request (from /proc) and the times per 1,000 requests the kernel preempted its threads, and each
round's user µs, req/s and p99. Loopback only; about 5 s per variant
per round.
"""
import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead as o  # noqa: E402


def start(d, name, spec, up_port):
    """The variant's process, its port and the pids whose CPU time counts."""
    if spec.startswith("nginx:"):
        port = o.free_port()
        p = o.start_nginx(d, name, o.nginx_proxy(port, up_port), int(spec.split(":", 1)[1]))
        o.wait_port(port)
        return p, port, o.pids_of(p)
    binary, _, config = spec.partition(":")
    args = ["--config", config] if config else []
    p, port, _ = o.start_kvroute(binary, up_port, admin=False, args=args)
    o.wait_port(port)
    return p, port, [p.pid]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("variants", nargs="+", metavar="NAME=SPEC")
    a = ap.parse_args()
    o.ensure_tools()
    variants = [v.split("=", 1) for v in a.variants]
    d = tempfile.mkdtemp(prefix="kvroute-variants-")
    os.chmod(d, 0o755)
    up_port = o.free_port()
    upstream = o.start_upstream(d, up_port)
    o.wait_port(up_port)
    procs = {}
    try:
        for name, spec in variants:
            procs[name] = start(d, name, spec, up_port)
        lua = f"{d}/post.lua"
        with open(lua, "w") as f:
            f.write(f'wrk.method = "POST"\nwrk.body = \'{o.BODY}\'\nwrk.headers["Content-Type"] = "application/json"\n')
        results = {}
        for r in range(a.rounds):
            names = [n for n, _ in variants]
            # Rotated each round, as in overhead.py: no variant always runs in one place.
            for n in names[r % len(names):] + names[:r % len(names)]:
                _, port, pids = procs[n]
                w = o.measured_wrk(f"http://127.0.0.1:{port}/v1/completions", a.seconds, lua, pids)
                results.setdefault(n, []).append(w)
        print(f"wrk -t1 -c32 -d{a.seconds}s, POST /v1/completions; {a.rounds} interleaved rounds; medians")
        print()
        print("| variant | req/s | p99 ms | user / system µs per req | preempted per 1k req | user µs each round | req/s each round | p99 ms each round | non-2xx |")
        print("|---|---:|---:|---:|---:|---|---|---|---:|")
        for n, _ in variants:
            rs = results[n]
            med = lambda k: statistics.median(x[k] for x in rs)
            print(f"| {n} | {med('rps'):,.0f} | {med('p99'):.2f} | {med('user_us'):.2f} / {med('sys_us'):.2f} | "
                  f"{med('preempted_k'):.0f} | "
                  f"{' '.join('%.2f' % x['user_us'] for x in rs)} | {' '.join('%.0f' % x['rps'] for x in rs)} | "
                  f"{' '.join('%.2f' % x['p99'] for x in rs)} | {sum(x['non2xx'] for x in rs)} |")
    finally:
        o.stop_all([p for p, _, _ in procs.values()] + [upstream], d)


if __name__ == "__main__":
    sys.exit(main())
