#!/usr/bin/env python3
"""Hostile-client figures for the gateway, on loopback, with the standard library only.

    python3 benches/hardening.py [--bin target/release/kvroute] [slowloris] [cpu8m]

slowloris: 2,000 connections that send their request headers one byte a second and 200 that
           send an 8 MiB body 1 KiB a second, held for --hold seconds, while a normal client
           asks /health and a small completion every 100 ms: its latencies (measured from a separate process), how many of the slow
           connections the gateway cut off, and the gateway's resident memory.
cpu8m:     gateway CPU seconds per 8 MiB `{"prompt": [[1],[1],...]}` request on /v1/completions
           (routing key extracted) and on a pass-through path (no routing key), from /proc.

The gateway runs with its defaults (10 s header timeout, 30 s body timeout, 8,192 connections)
in front of one simulated worker; both are started and stopped here.
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time


def start(bin_path, args):
    p = subprocess.Popen([bin_path, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline().strip()
    return p, line


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


async def timed_request(host, port, method, path, body=b""):
    t0 = time.perf_counter()
    r, w = await asyncio.open_connection(host, port)
    w.write(
        f"{method} {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body
    )
    await w.drain()
    data = await r.read()
    w.close()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, (time.perf_counter() - t0) * 1000


async def slow_headers(host, port, cut):
    try:
        r, w = await asyncio.open_connection(host, port)
    except OSError:
        return
    head = f"GET /health HTTP/1.1\r\nhost: {host}\r\nx-slow: " + "a" * 10000
    try:
        for ch in head:
            w.write(ch.encode())
            await w.drain()
            try:
                await asyncio.wait_for(r.read(1), 1.0)
                cut["headers"] += 1  # an answer or the connection closed: cut off
                return
            except asyncio.TimeoutError:
                pass
    except OSError:
        cut["headers"] += 1


async def slow_body(host, port, cut):
    try:
        r, w = await asyncio.open_connection(host, port)
    except OSError:
        return
    w.write(
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {8 << 20}\r\n\r\n".encode()
    )
    try:
        while True:
            w.write(b" " * 1024)
            await w.drain()
            try:
                data = await asyncio.wait_for(r.read(64), 1.0)
                cut["bodies"] += 1
                if data.startswith(b"HTTP/1.1 408"):
                    cut["bodies_408"] += 1
                return
            except asyncio.TimeoutError:
                pass
    except OSError:
        cut["bodies"] += 1


async def attack(host, port, hold, out):
    """The hostile connections, in their own process so that the normal client's latencies are
    the gateway's and not this event loop's (2,200 sockets keep a Python loop busy)."""
    cut = {"headers": 0, "bodies": 0, "bodies_408": 0}
    attackers = [asyncio.create_task(slow_headers(host, port, cut)) for _ in range(2000)]
    attackers += [asyncio.create_task(slow_body(host, port, cut)) for _ in range(200)]
    await asyncio.sleep(hold)
    for t in attackers:
        t.cancel()
    await asyncio.gather(*attackers, return_exceptions=True)
    out.put(cut)


def attacker_process(host, port, hold, out):
    asyncio.run(attack(host, port, hold, out))


def blocking_request(host, port, method, path, body=b""):
    """One request on a fresh connection with a plain blocking socket; (status, milliseconds)."""
    t0 = time.perf_counter()
    with socket.create_connection((host, port)) as s:
        s.sendall(
            f"{method} {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, (time.perf_counter() - t0) * 1000


def slowloris(host, port, pid, hold):
    base_rss = rss_mib(pid)
    out = multiprocessing.Queue()
    hostile = multiprocessing.Process(target=attacker_process, args=(host, port, hold, out))
    hostile.start()
    time.sleep(1.0)  # let the hostile connections open before the first measurement
    health, completion, statuses, peak = [], [], [], base_rss
    small = json.dumps({"prompt": "hello", "max_tokens": 4}).encode()
    end = time.monotonic() + hold - 1.5
    while time.monotonic() < end:
        s1, ms1 = blocking_request(host, port, "GET", "/health")
        s2, ms2 = blocking_request(host, port, "POST", "/v1/completions", small)
        health.append(ms1)
        completion.append(ms2)
        statuses += [s1, s2]
        peak = max(peak, rss_mib(pid))
        time.sleep(0.1)
    cut = out.get()
    hostile.join()

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    print(f"slowloris: 2,000 slow-header + 200 slow-body connections for {hold} s (hostile client in its own process)")
    print(f"  normal client: {len(health)} /health, p50 {pct(health, .5):.1f} ms, p99 {pct(health, .99):.1f} ms, max {max(health):.1f} ms")
    print(f"  normal client: {len(completion)} completions, p50 {pct(completion, .5):.1f} ms, p99 {pct(completion, .99):.1f} ms, max {max(completion):.1f} ms")
    print(f"  statuses other than 200: {sum(1 for s in statuses if s != 200)}")
    print(f"  cut off by the gateway: {cut['headers']} slow-header, {cut['bodies']} slow-body ({cut['bodies_408']} with 408)")
    print(f"  gateway RSS: {base_rss:.1f} MiB before, peak {peak:.1f} MiB")


async def cpu8m(host, port, pid, n):
    body = b'{"prompt": [' + b",".join([b"[1]"] * ((8 << 20) // 4 - 8)) + b"]}"
    assert len(body) <= 8 << 20, len(body)
    out = {}
    for path in ["/v1/completions", "/v1/other"]:
        c0 = cpu_seconds(pid)
        statuses = []
        for _ in range(n):
            s, _ = await timed_request(host, port, "POST", path, body)
            statuses.append(s)
        out[path] = (cpu_seconds(pid) - c0) / n
        print(f"cpu8m: {path}: {out[path] * 1000:.1f} ms gateway CPU per 8 MiB request ({n} requests, statuses {sorted(set(statuses))})")
    print(f"cpu8m: routed / pass-through = {out['/v1/completions'] / max(out['/v1/other'], 1e-9):.2f}x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/kvroute")
    ap.add_argument("--hold", type=int, default=20)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("what", nargs="*", default=["slowloris", "cpu8m"])
    a = ap.parse_args()
    sim, url = start(a.bin, ["sim", "--workers", "1", "--port", "0", "--time-scale", "50"])
    gw, line = start(a.bin, ["serve", "--listen", "127.0.0.1:0", "--worker", url])
    host, port = line.rsplit(" ", 1)[1].replace("http://", "").rsplit(":", 1)
    try:
        if "slowloris" in a.what:
            slowloris(host, int(port), gw.pid, a.hold)
        if "cpu8m" in a.what:
            asyncio.run(cpu8m(host, int(port), gw.pid, a.n))
    finally:
        gw.kill()
        sim.kill()


if __name__ == "__main__":
    sys.exit(main())
