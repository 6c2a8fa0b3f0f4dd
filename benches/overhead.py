#!/usr/bin/env python3
"""Proxy overhead: the same load direct to a fast upstream, through kvroute and through nginx.

    python3 benches/overhead.py [--bin target/release/kvroute] [--rounds N] [--seconds 5]
                                [--baseline OTHER_KVROUTE_BINARY] [--threads N]

Everything runs on loopback, each in its own process:
- the upstream: an nginx that answers `POST /v1/completions` at once with a small JSON
  completion, or with a 100-event SSE stream when the query has `sse=1` (or, for the memory
  test, a stream that trickles out over minutes when it has `hold=1`);
- kvroute (its default policy) and nginx as a plain reverse proxy (keep-alive upstream
  connections, `proxy_buffering off`, as many worker processes as kvroute has runtime threads:
  one per core), both in front of that upstream;
- the load: `wrk -t1 -c32` POSTing a small completion request, direct / kvroute / nginx
  interleaved in each round, the order rotated by one place each round; by default as many
  rounds as there are targets, so every target runs once in every place.

With `--threads N`, kvroute runs N event loops and nginx N worker processes instead of one per
core.

With `--pin K`, the proxies get the last K cores to themselves and the load generator and the
upstream the others, so neither proxy waits for a core that wrk or the upstream holds (one event
loop and one nginx worker per proxy core unless --threads says otherwise).

With `--baseline`, a second kvroute (another build, e.g. the commit before a change) joins the
interleaved rounds as `kvroute-baseline`, so a change is measured against its parent side by
side, and holds its 5,000 streams too.

Reports req/s and p50/p99 latency per target and shape (median over rounds, and each round),
the proxies' CPU seconds per 10k requests and its user and system parts per request (from /proc),
how often per 1,000 requests the kernel preempted a proxy's threads (involuntary context
switches: a preempted event loop's connections all wait until it runs again), and each proxy's
resident memory per
open stream with 5,000 streams held open, with /health latency meanwhile (by default 200 probes 50 ms apart,
each on a new connection: kvroute's own route, and a `return 200` location in the nginx proxy).

Needs `wrk` and `nginx` (Debian: `apt-get install wrk nginx-light`); installs them when missing
and it may (root). Takes about 3 minutes with the defaults.
"""

import argparse
import asyncio
import glob
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

BODY = '{"model":"m","prompt":"Say hello to the proxy benchmark.","max_tokens":16}'
JSON_ANSWER = (
    '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
    '"text":" Hello, proxy benchmark!","logprobs":null,"finish_reason":"stop"}],"usage":'
    '{"prompt_tokens":8,"completion_tokens":6,"total_tokens":14}}'
)
SSE_ANSWER = "".join(
    'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" t%d","logprobs":null,"finish_reason":null}]}\n\n'
    % i
    for i in range(100)
) + "data: [DONE]\n\n"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_tools(tools=(("wrk", "wrk"), ("nginx", "nginx-light"))):
    """Installs the Debian package of each (command, package) whose command is missing."""
    pkgs = [p for t, p in tools if not shutil.which(t) and not os.path.exists("/usr/sbin/" + t)]
    if pkgs:
        subprocess.run(["apt-get", "install", "-y", "-q", *pkgs], check=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def nginx_bin():
    return shutil.which("nginx") or "/usr/sbin/nginx"


def start_nginx(dir_, name, http_block, workers, main_block="", wrap=()):
    """An nginx serving `http_block`, its config in `dir_/name`; `main_block` adds top-level
    directives, and `wrap` a command to run it under (benches/instructions.py: valgrind)."""
    os.makedirs(f"{dir_}/{name}", exist_ok=True)
    conf = f"""
{main_block}
worker_processes {workers};
worker_rlimit_nofile 20000;
pid {dir_}/{name}/nginx.pid;
error_log {dir_}/{name}/error.log error;
daemon off;
events {{ worker_connections 16384; }}
http {{
  access_log off;
  client_body_temp_path {dir_}/{name}/body;
  proxy_temp_path {dir_}/{name}/proxy;
  keepalive_requests 1000000;
  {http_block}
}}
"""
    path = f"{dir_}/{name}/nginx.conf"
    with open(path, "w") as f:
        f.write(conf)
    # Not our stdout: a worker outliving this script would hold a pipe reading it open.
    p = subprocess.Popen(
        [*wrap, nginx_bin(), "-c", path, "-e", f"{dir_}/{name}/error.log"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return p


def nginx_proxy(port, up_port):
    """nginx's http block as a plain reverse proxy on `port` to the upstream on `up_port`."""
    return f"""
  upstream workers {{ server 127.0.0.1:{up_port}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location = /health {{ return 200; }}
    location / {{
      proxy_pass http://workers;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
"""


def start_upstream(d, port):
    """The fast upstream on `port`: an nginx answering `POST /v1/completions` with a small JSON
    completion at once, or a 100-event SSE stream with `sse=1` (one that trickles out with
    `hold=1`). `d` must be readable by nginx's unprivileged workers."""
    os.makedirs(f"{d}/static/hold", mode=0o755, exist_ok=True)
    os.chmod(f"{d}/static", 0o755)
    for path in (f"{d}/static/sse.txt", f"{d}/static/hold/sse.txt"):
        with open(path, "w") as f:
            f.write(SSE_ANSWER)
    # Static files answer GET only: a POST's 405 is turned into the file (`error_page ... =200`).
    return start_nginx(d, "upstream", f"""
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    default_type application/json;
    location = /health {{ return 200; }}
    location = /v1/completions {{
      if ($arg_hold) {{ rewrite ^ /static/hold/sse.txt last; }}
      if ($arg_sse) {{ rewrite ^ /static/sse.txt last; }}
      return 200 '{JSON_ANSWER}';
    }}
    location /static/ {{
      root {d};
      default_type text/event-stream;
      error_page 405 =200 $uri;
    }}
    location /static/hold/ {{
      root {d};
      default_type text/event-stream;
      error_page 405 =200 $uri;
      limit_rate_after 1k;
      limit_rate 2;
    }}
  }}
""", 1)


def start_kvroute(binary, up_port, admin=True, wrap=(), args=()):
    """kvroute (its default policy, or what `args` to `serve` say) in front of the upstream on
    `up_port`, under `wrap` if given (benches/instructions.py: valgrind): the process, its port,
    and its admin listener's port (None without `admin`, or for a build without one)."""
    admin = admin and "--admin-listen" in subprocess.run(
        [binary, "serve", "--help"], capture_output=True, text=True).stdout
    p = subprocess.Popen(
        [*wrap, binary, "serve", *args, "--listen", "127.0.0.1:0", "--worker", f"http://127.0.0.1:{up_port}"]
        + (["--admin-listen", "127.0.0.1:0"] if admin else []),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "RUST_LOG": "error"},
    )

    def port():
        line = p.stdout.readline().strip()
        if not line:
            p.kill()
            raise SystemExit(f"{binary} printed no listen address")
        return int(line.rsplit(":", 1)[1])

    return p, port(), port() if admin else None


def wait_port(port, timeout=10):
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


def pids_of(p, name_dir=None):
    """The process and its children (nginx workers)."""
    out = [p.pid]
    try:
        kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        out += [int(k) for k in kids]
    except FileNotFoundError:
        pass
    return out


def cpu_seconds(pids):
    """User and system CPU seconds the processes have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    user = system = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            user += int(fields[11]) / tick
            system += int(fields[12]) / tick
        except OSError:
            pass
    return user, system


def preemptions(pids):
    """Involuntary context switches of every thread of the processes so far."""
    total = 0
    for pid in pids:
        for status in glob.glob(f"/proc/{pid}/task/*/status"):
            try:
                with open(status) as f:
                    for line in f:
                        if line.startswith("nonvoluntary_ctxt_switches:"):
                            total += int(line.split()[1])
            except OSError:
                pass
    return total


def measured_wrk(url, seconds, lua, pids):
    """`wrk`'s result for `url`, with the CPU the processes `pids` spent on it per request
    (`user_us`, `sys_us`, `cpu10k`: seconds per 10k requests) and the times per 1,000 requests
    the kernel preempted their threads (`preempted_k`); those are None without `pids`."""
    u0, s0 = cpu_seconds(pids)
    n0 = preemptions(pids)
    res = wrk(url, seconds, lua)
    u1, s1 = cpu_seconds(pids)
    per_req = lambda v: v / res["requests"] if pids else None
    res["user_us"] = per_req((u1 - u0) * 1e6)
    res["sys_us"] = per_req((s1 - s0) * 1e6)
    res["preempted_k"] = per_req((preemptions(pids) - n0) * 1000)
    res["cpu10k"] = (res["user_us"] + res["sys_us"]) / 100 if pids else None
    return res


def rss_bytes(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def wrk(url, seconds, lua):
    out = subprocess.run(
        ["wrk", "-t1", "-c32", f"-d{seconds}s", "--latency", "-s", lua, url],
        capture_output=True, text=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    reqs = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    lat = {}
    for q in ("50", "99"):
        m = re.search(rf"\s{q}%\s+([\d.]+)(us|ms|s)", out)
        v, unit = float(m.group(1)), m.group(2)
        lat[q] = v / 1000 if unit == "us" else v * 1000 if unit == "s" else v
    return {"rps": rps, "p50": lat["50"], "p99": lat["99"], "requests": reqs, "non2xx": int(non2xx.group(1)) if non2xx else 0}


# Prints the milliseconds each GET /health took, each on a new connection.
HEALTH_PROBE = """
import socket, sys, time
port, n, every = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
for _ in range(n):
    time.sleep(every)
    t0 = time.perf_counter()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /health HTTP/1.1\\r\\nhost: x\\r\\nconnection: close\\r\\n\\r\\n")
    while s.recv(4096):
        pass
    s.close()
    print((time.perf_counter() - t0) * 1000)
"""


async def hold_streams(port, n, path, health_ports, probes, every):
    """Opens n streams through the proxy on `port`, reads their first bytes, keeps them open, and
    probes `/health` on each of `health_ports` (label, port) meanwhile: `probes` probes, `every`
    seconds apart."""
    conns = []
    req = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(BODY)}\r\n\r\n{BODY}"
    ).encode()
    sem = asyncio.Semaphore(1000)

    async def one():
        async with sem:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(req)
            await w.drain()
            await r.readuntil(b"\r\n\r\n")  # the stream's head: it is open
            conns.append((r, w))

    await asyncio.gather(*[one() for _ in range(n)])
    lats = await asyncio.gather(*[probe_health(port, probes, every) for _, port in health_ports])
    return conns, {label: lat for (label, _), lat in zip(health_ports, lats)}


async def probe_health(health_port, probes, every):
    """Milliseconds per GET /health, from a process of its own: this one's event loop is busy
    with the held streams' bytes (the upstream releases them once a second), and a probe here
    would wait for that too. Spread out in time, so the probes meet whatever the streams do."""
    probe = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HEALTH_PROBE, str(health_port), str(probes), str(every),
        stdout=subprocess.PIPE,
    )
    out, _ = await probe.communicate()
    return [float(x) for x in out.split()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/kvroute")
    ap.add_argument("--rounds", type=int, help="default: one per target (3, or 4 with --baseline)")
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=5000)
    ap.add_argument("--memory-only", action="store_true", help="skip the wrk rounds")
    ap.add_argument("--health-probes", type=int, default=200, help="/health probes per port while streams are held")
    ap.add_argument("--health-every", type=float, default=0.05, help="seconds between /health probes")
    ap.add_argument("--baseline", help="another kvroute binary, measured beside --bin")
    ap.add_argument("--threads", type=int,
                    help="kvroute's event loops (a config file with `threads: N`) and nginx's worker "
                         "processes; default one per core (with --pin, one per proxy core)")
    ap.add_argument("--pin", type=int, metavar="K",
                    help="give the proxies the last K cores and the load generator and upstream the "
                         "others (sched_setaffinity), so a proxy never waits for a core they hold")
    a = ap.parse_args()
    ensure_tools()
    proxy_wrap = ()
    if a.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if not 0 < a.pin < len(cpus):
            raise SystemExit(f"--pin {a.pin}: needs 1 to {len(cpus) - 1} of the {len(cpus)} cores")
        proxy_cpus, load_cpus = cpus[-a.pin:], cpus[:-a.pin]
        # This script, wrk and the upstream inherit the load cores; the proxies run under taskset.
        os.sched_setaffinity(0, load_cpus)
        proxy_wrap = ("taskset", "-c", ",".join(map(str, proxy_cpus)))
    loops = a.threads or (a.pin or os.cpu_count())
    d = tempfile.mkdtemp(prefix="kvroute-overhead-")
    os.chmod(d, 0o755)  # nginx's workers run as an unprivileged user and read the static files
    kv_args = ()
    if a.threads:
        with open(f"{d}/kvroute.yaml", "w") as f:
            f.write(f"threads: {a.threads}\n")
        kv_args = ("--config", f"{d}/kvroute.yaml")
    up_port, ngx_port = free_port(), free_port()
    upstream = start_upstream(d, up_port)
    proxy = start_nginx(d, "proxy", nginx_proxy(ngx_port, up_port), loops, wrap=proxy_wrap)
    kv, kv_port, kv_admin = start_kvroute(a.bin, up_port, args=kv_args, wrap=proxy_wrap)
    base, base_port, base_admin = (
        start_kvroute(a.baseline, up_port, args=kv_args, wrap=proxy_wrap) if a.baseline
        else (None, None, None)
    )
    for p in (up_port, ngx_port, kv_port, base_port):
        if p:
            wait_port(p)
    lua = f"{d}/post.lua"
    with open(lua, "w") as f:
        f.write(f'wrk.method = "POST"\nwrk.body = \'{BODY}\'\nwrk.headers["Content-Type"] = "application/json"\n')
    targets = {"direct": (up_port, None), "kvroute": (kv_port, [kv.pid])}
    if base:
        targets["kvroute-baseline"] = (base_port, [base.pid])
    targets["nginx"] = (ngx_port, pids_of(proxy))
    rounds = a.rounds or len(targets)
    results = {}
    try:
        for shape, query in (("json", ""), ("sse-100", "?sse=1")):
            for r in range(0 if a.memory_only else rounds):
                # Each round starts one target later: whichever target runs right after
                # `direct` comes out slower (seen here: 0.86-0.91x the same build run in the
                # next place), so a fixed order would handicap one target.
                names = list(targets)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    port, pids = targets[name]
                    url = f"http://127.0.0.1:{port}/v1/completions{query}"
                    res = measured_wrk(url, a.seconds, lua, pids or [])
                    results.setdefault((shape, name), []).append(res)
        if a.memory_only:
            results = {}
        pinned = f" (proxies pinned to cores {proxy_wrap[2]}, load and upstream to the others)" if a.pin else ""
        print(f"wrk -t1 -c32 -d{a.seconds}s, POST /v1/completions; {rounds} interleaved rounds; {os.cpu_count()} cores{pinned}, {loops} event loops and nginx workers; medians (each round)")
        print()
        print("| shape | target | req/s | p50 ms | p99 ms | proxy CPU s / 10k req | user / system µs per req | preempted per 1k req | non-2xx |")
        print("|---|---|---|---|---|---|---|---|---|")
        for (shape, name), rs in results.items():
            med = lambda k: statistics.median(x[k] for x in rs)
            each = lambda k, fmt: " ".join(fmt % x[k] for x in rs)
            proxied = rs[0]["cpu10k"] is not None
            cpu = "%.2f (%s)" % (med("cpu10k"), each("cpu10k", "%.2f")) if proxied else "-"
            split = "%.1f / %.1f" % (med("user_us"), med("sys_us")) if proxied else "-"
            preempted = "%.0f" % med("preempted_k") if proxied else "-"
            print(f"| {shape} | {name} | {med('rps'):,.0f} ({each('rps', '%.0f')}) | {med('p50'):.2f} | {med('p99'):.2f} ({each('p99', '%.2f')}) | {cpu} | {split} | {preempted} | {sum(x['non2xx'] for x in rs)} |")
        print()
        for shape in ("json", "sse-100") if results else ():
            k = statistics.median(x["rps"] for x in results[(shape, "kvroute")])
            n = statistics.median(x["rps"] for x in results[(shape, "nginx")])
            kp = statistics.median(x["p99"] for x in results[(shape, "kvroute")])
            np_ = statistics.median(x["p99"] for x in results[(shape, "nginx")])
            ratio = lambda key: statistics.median(x[key] for x in results[(shape, "kvroute")]) / statistics.median(x[key] for x in results[(shape, "nginx")])
            nginx_preempted = statistics.median(x["preempted_k"] for x in results[(shape, "nginx")])
            preempted_ratio = f"{ratio('preempted_k'):.2f}x" if nginx_preempted > 0 else "- (nginx: none)"
            print(f"{shape}: kvroute / nginx req/s {k / n:.2f}x, p99 {kp / np_:.2f}x, CPU per request: user {ratio('user_us'):.2f}x, system {ratio('sys_us'):.2f}x; preempted per request {preempted_ratio}")
            if base:
                b = statistics.median(x["rps"] for x in results[(shape, "kvroute-baseline")])
                bp = statistics.median(x["p99"] for x in results[(shape, "kvroute-baseline")])
                kc = statistics.median(x["cpu10k"] for x in results[(shape, "kvroute")])
                bc = statistics.median(x["cpu10k"] for x in results[(shape, "kvroute-baseline")])
                print(f"{shape}: kvroute / baseline req/s {k / b:.2f}x, p99 {kp / bp:.2f}x, CPU per request {kc / bc:.2f}x")
        # Memory per open stream.
        print()
        # /health on the proxy's own port, and on kvroute's admin port where the build has one.
        def probes(port, admin):
            return [("", port)] + ([(" (admin port)", admin)] if admin else [])
        held = [("kvroute", kv_port, [kv.pid], probes(kv_port, kv_admin))]
        if base:
            held.append(("kvroute-baseline", base_port, [base.pid], probes(base_port, base_admin)))
        held.append(("nginx", ngx_port, pids_of(proxy), probes(ngx_port, None)))
        for name, port, pids, health in held:
            before = rss_bytes(pids)
            print(f"holding {a.streams} streams through {name}...", file=sys.stderr, flush=True)
            asyncio.run(_hold(port, a.streams, health, pids, before, name, a.health_probes, a.health_every))
    finally:
        stop_all([p for p in (kv, base, proxy, upstream) if p], d)


def stop_all(procs, d):
    """Stops the processes and anything left running from directory `d`, and removes `d`."""
    # SIGTERM: nginx's master stops its workers (SIGKILL would orphan them).
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    subprocess.run(["pkill", "-f", d], stderr=subprocess.DEVNULL)
    shutil.rmtree(d, ignore_errors=True)


async def _hold(port, n, health, pids, before, name, probes, every):
    conns, lats = await hold_streams(port, n, "/v1/completions?sse=1&hold=1", health, probes, every)
    after = rss_bytes(pids)
    per = (after - before) / n
    print(f"{name}: {n} open streams: resident {before / 2**20:.1f} -> {after / 2**20:.1f} MiB, {per / 1024:.1f} KiB per stream")
    for label, lat in lats.items():
        lat.sort()
        print(
            f"{name}: /health{label} meanwhile ({len(lat)} probes {every * 1000:.0f} ms apart) p50 {lat[len(lat) // 2]:.2f} ms,"
            f" p99 {lat[int(len(lat) * 0.99)]:.2f} ms, max {lat[-1]:.2f} ms, over 10 ms: {sum(x > 10 for x in lat)}"
        )
    for r, w in conns:
        w.close()


if __name__ == "__main__":
    sys.exit(main())
