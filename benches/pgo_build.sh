#!/usr/bin/env bash
# A profile-guided build of the gateway:
#
#     benches/pgo_build.sh [OUT]      # default OUT: target/pgo/kvroute
#
# 1. builds kvroute instrumented (`-Cprofile-generate`), in target/pgo-gen;
# 2. trains it: the instrumented gateway in front of 2 simulated workers, driven by
#    `kvroute bench run` (streaming chat for 20 s, then zipf for 10 s) and then non-streaming
#    completions and chats from 8 Python clients for 10 s. The workers and the load
#    come from the plain release build, so only the gateway's code is profiled. This is kvroute's
#    own traffic, not benches/overhead.py's load (an nginx upstream, small JSON answers and
#    100-event streams), so a figure measured with that bench is not measured on the training;
# 3. merges the profile with rustup's `llvm-profdata` (component llvm-tools, added when missing)
#    and builds again with `-Cprofile-use`, in target/pgo-use, and copies the binary to OUT.
#
# Takes about 17 minutes on 2 cores (three release builds with fat LTO). Everything runs on
# loopback. Measured against the plain build in docs/measurements.md ("Proxy overhead against
# nginx").
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/pgo/kvroute}
data=$(mktemp -d)
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$data" "$work"
}
trap cleanup EXIT

rustup component add llvm-tools >/dev/null 2>&1 || rustup component add llvm-tools-preview
sysroot=$(rustc --print sysroot)
host=$(rustc -vV | sed -n 's/^host: //p')
profdata="$sysroot/lib/rustlib/$host/bin/llvm-profdata"

echo "== plain build (workers and load)"
cargo build --release --locked --bin kvroute
plain=target/release/kvroute

echo "== instrumented build"
RUSTFLAGS="-Cprofile-generate=$data" cargo build --release --locked --bin kvroute --target-dir target/pgo-gen

echo "== training"
"$plain" sim --workers 2 --port 0 --time-scale 100 > "$work/sim.out" 2>/dev/null &
pids+=($!)
for _ in $(seq 100); do [ "$(wc -l < "$work/sim.out")" -ge 2 ] && break; sleep 0.1; done
workers=()
while read -r url _; do workers+=(--worker "$url"); done < "$work/sim.out"
LLVM_PROFILE_FILE="$data/kvroute-%p.profraw" target/pgo-gen/release/kvroute serve --listen 127.0.0.1:0 "${workers[@]}" > "$work/gw.out" 2>/dev/null &
gw=$!
pids+=("$gw")
for _ in $(seq 100); do grep -q listening "$work/gw.out" && break; sleep 0.1; done
url=$(grep -o 'http://[0-9.:]*' "$work/gw.out")
"$plain" bench run --url "$url" --workload chat --concurrency 64 --warmup 2 --duration 20 --time-scale 100 >/dev/null
"$plain" bench run --url "$url" --workload zipf --concurrency 32 --warmup 1 --duration 10 --time-scale 100 >/dev/null
# `kvroute bench` always streams: non-streaming completions and chats, 8 kept-alive clients, 10 s.
python3 - "$url" <<'PY'
import http.client, json, sys, threading, time
host, port = sys.argv[1].removeprefix("http://").rsplit(":", 1)
c = http.client.HTTPConnection(host, int(port))
c.request("GET", "/v1/models")
model = json.loads(c.getresponse().read())["data"][0]["id"]
end = time.time() + 10
answered = [0] * 8
def client(k):
    c = http.client.HTTPConnection(host, int(port))
    i = 0
    while time.time() < end:
        i += 1
        if i % 2:
            path, body = "/v1/completions", {"model": model, "prompt": f"client {k} asks question {i % 50}", "max_tokens": 4}
        else:
            path, body = "/v1/chat/completions", {"model": model, "max_tokens": 4, "messages": [
                {"role": "system", "content": "You answer briefly."}, {"role": "user", "content": f"question {i % 50}"}]}
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        answered[k] += r.status == 200
threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(f"non-streaming: {sum(answered)} answered")
if sum(answered) == 0:
    sys.exit("no non-streaming request was answered")
PY
# The profile is written when the process exits: a graceful stop.
kill -TERM "$gw"
wait "$gw" || true
ls "$data"/*.profraw >/dev/null

echo "== optimised build"
"$profdata" merge -o "$work/merged.profdata" "$data"
RUSTFLAGS="-Cprofile-use=$work/merged.profdata" cargo build --release --locked --bin kvroute --target-dir target/pgo-use
mkdir -p "$(dirname "$out")"
cp target/pgo-use/release/kvroute "$out"
echo "built $out"
