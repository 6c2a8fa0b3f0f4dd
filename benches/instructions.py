#!/usr/bin/env python3
"""Instructions the gateway runs per proxied request, counted by callgrind: a measure that does
not move with the machine's load, for changes too small for wrk to resolve.

    python3 benches/instructions.py [--bin target/release/kvroute] [--baseline OTHER_BINARY]
                                    [--nginx] [--shape json,sse] [--requests 2000]
                                    [--warmup 300] [--repeat 1] [--top 12]

Loopback only. The upstream is the nginx of benches/overhead.py (a small JSON completion at once,
or a 100-event SSE stream when the query has `sse=1`). kvroute (its default policy, in front of
that one upstream) runs under `valgrind --tool=callgrind` with counting off. One kept-alive
connection from this script sends the warm-up requests. Counting is then switched on
(`callgrind_control -i on`) for the counted requests and off again, so start-up, warm-up and
shutdown are not counted. With --nginx, nginx as benches/overhead.py's plain reverse proxy
(one process, `master_process off`) is counted the same way. Counts are the proxy process's
user-space instructions: the kernel's work (system calls, the loopback's TCP) is not in them,
nor any time spent waiting.

Prints, for each binary and shape, instructions per request (with --repeat, each run's and their
median), the ratio to --baseline, and the largest shares by where they ran. Shares go by the
function each instruction ran in, so code inlined into a function counts as that function's
crate: `kvroute::proxy::send_among` holds much of hyper's and http's code that LTO inlined
there. Runs repeated on one binary agree to within about 1% (timers and background polls
falling into the window), against several percent for wrk's requests a second between runs.

Needs valgrind and nginx (Debian: `apt-get install valgrind nginx-light`); installs them when
missing and it may (root). About 5 s per run plus valgrind's start-up.
"""

import argparse
import collections
import http.client
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import (  # noqa: E402
    BODY, ensure_tools, free_port, nginx_proxy, start_kvroute, start_nginx, start_upstream,
    wait_port,
)


def callgrind(out):
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]


def start_nginx_proxy(d, up_port, out):
    """nginx as benches/overhead.py's plain reverse proxy, one process (no master), under
    callgrind, counting off; the process and its port."""
    port = free_port()
    p = start_nginx(d, f"proxy-{os.path.basename(out)}", nginx_proxy(port, up_port), 1,
                    main_block="master_process off;", wrap=callgrind(out))
    wait_port(port, timeout=60)
    return p, port


def count(start, shape, warmup, requests, out):
    """Counted instructions per request of one run of the target `start(out)` starts."""
    kv, port = start(out)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        path = "/v1/completions?sse=1" if shape == "sse" else "/v1/completions"

        def one():
            conn.request("POST", path, BODY, {"Content-Type": "application/json"})
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                raise SystemExit(f"{shape}: status {r.status}: {body[:200]!r}")
            if shape == "sse" and body.count(b"data:") != 101:
                raise SystemExit(f"sse: {body.count(b'data:')} events relayed, not 101")

        for _ in range(warmup):
            one()
        subprocess.run(["callgrind_control", "-i", "on", str(kv.pid)], check=True, capture_output=True)
        for _ in range(requests):
            one()
        subprocess.run(["callgrind_control", "-i", "off", str(kv.pid)], check=True, capture_output=True)
        conn.close()
    finally:
        kv.terminate()
        kv.wait()
    return annotate(out, requests)


# `Ir (share)  file:function [object]`; the object is left out on lines for code inlined from
# another file than the function's.
LINE = re.compile(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*?):(.*?)(?: \[(.*)\])?\s*$")


def annotate(out, requests):
    """(instructions per request, {group: instructions per request}) from a callgrind file."""
    text = subprocess.run(["callgrind_annotate", "--auto=no", "--threshold=100", out],
                          capture_output=True, text=True, check=True).stdout
    total = None
    groups = collections.Counter()
    for line in text.splitlines():
        if "PROGRAM TOTALS" in line:
            total = int(line.split()[0].replace(",", ""))
            continue
        m = LINE.match(line)
        if m:
            groups[group(m.group(2), m.group(3), m.group(4) or "")] += int(m.group(1).replace(",", ""))
    if total is None:
        raise SystemExit(f"no totals in {out}")
    return total / requests, {k: v / requests for k, v in groups.items()}


def group(source, function, obj):
    """Where a function's instructions are counted: its crate, or the shared object's part."""
    base = os.path.basename(obj)
    # glibc's debug info names its sources relative to its build tree (`./malloc/malloc.c`).
    if base.startswith("libc.so") or (not base and source.startswith("./")):
        if "malloc" in function or "free" in function or function.startswith("_int_"):
            return "libc: allocator"
        if function.startswith("__mem") or function.startswith("mem"):
            return "libc: memcpy/memset"
        return "libc: other"
    if "vdso" in base:
        return "vdso (clock)"
    if base.startswith("ld-linux"):
        return "ld.so"
    if "::" not in function:
        # C: nginx's own functions, or a library's.
        return base
    # `<hyper::proto::h1::role::Server as ...>::encode` counts for hyper; `<core::pin::Pin<P> as
    # ...>::poll` for the standard library.
    name = function.lstrip("<&*")
    if name.startswith("mut "):
        name = name[4:]
    crate = re.split(r"[^A-Za-z0-9_]", name, maxsplit=1)[0]
    if crate in ("core", "alloc", "std", "__rustc"):
        return "Rust standard library"
    return crate or "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/kvroute")
    ap.add_argument("--baseline", help="a second kvroute binary, counted the same way")
    ap.add_argument("--nginx", action="store_true",
                    help="count nginx as a plain reverse proxy (one process) beside them")
    ap.add_argument("--shape", default="json,sse", help="json, sse or both (comma-separated)")
    ap.add_argument("--requests", type=int, default=2000, help="counted requests per run")
    ap.add_argument("--warmup", type=int, default=300, help="uncounted requests first")
    ap.add_argument("--repeat", type=int, default=1, help="runs per binary and shape")
    ap.add_argument("--top", type=int, default=12, help="groups shown per binary and shape")
    a = ap.parse_args()
    shapes = [s.strip() for s in a.shape.split(",") if s.strip()]
    if not shapes or any(s not in ("json", "sse") for s in shapes):
        ap.error("--shape takes json, sse or json,sse")
    if a.requests < 1 or a.repeat < 1 or a.warmup < 0:
        ap.error("--requests and --repeat must be at least 1, --warmup at least 0")
    ensure_tools((("valgrind", "valgrind"), ("nginx", "nginx-light")))
    for path in (a.bin, a.baseline):
        if path and not os.access(path, os.X_OK):
            raise SystemExit(f"not an executable: {path}")
    d = tempfile.mkdtemp(prefix="kvroute-instructions-")
    os.chmod(d, 0o755)  # nginx's workers run as an unprivileged user and read the static files
    up_port = free_port()
    upstream = start_upstream(d, up_port)
    wait_port(up_port)
    def kvroute(binary):
        """Starts `binary` under callgrind, counting off; the process and its port."""
        return lambda out: start_kvroute(binary, up_port, admin=False, wrap=callgrind(out))[:2]

    builds = [("kvroute", kvroute(a.bin))]
    if a.baseline:
        builds.append(("baseline", kvroute(a.baseline)))
    if a.nginx:
        builds.append(("nginx", lambda out: start_nginx_proxy(d, up_port, out)))
    try:
        results = {}
        for shape in shapes:
            for name, start in builds:
                results[(shape, name)] = [
                    count(start, shape, a.warmup, a.requests, f"{d}/callgrind.{name}.{shape}.{i}")
                    for i in range(a.repeat)
                ]
    finally:
        upstream.terminate()
        upstream.wait()
        shutil.rmtree(d, ignore_errors=True)

    print(f"user-space instructions per proxied request (callgrind; {a.warmup} warm-up, "
          f"{a.requests} counted on one kept-alive connection; {a.repeat} run(s) each)\n")
    print("| shape | target | instructions / request | runs |")
    print("|---|---|---:|---|")
    medians = {}
    for shape in shapes:
        for name, _ in builds:
            per = [r[0] for r in results[(shape, name)]]
            medians[(shape, name)] = statistics.median(per)
            print(f"| {shape} | {name} | {medians[(shape, name)]:,.0f} | {' '.join(f'{p:,.0f}' for p in per)} |")
    ratios = [
        f"{shape}: kvroute / {other} {medians[(shape, 'kvroute')] / medians[(shape, other)]:.4f}x"
        for shape in shapes for other in ("baseline", "nginx") if (shape, other) in medians
    ]
    if ratios:
        print("\n" + "\n".join(ratios))
    for shape in shapes:
        for name, _ in builds:
            # The groups of the run closest to the median.
            runs = results[(shape, name)]
            _, groups = min(runs, key=lambda r: abs(r[0] - medians[(shape, name)]))
            print(f"\n{shape}, {name}: largest shares, by the function each instruction ran in")
            for g, v in sorted(groups.items(), key=lambda kv: -kv[1])[: a.top]:
                print(f"  {g:28s} {v:9,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
