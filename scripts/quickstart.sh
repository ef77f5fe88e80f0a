#!/usr/bin/env bash
# The main command (README): install, make the tiny model, launch a 1-prefill/1-decode fleet
# behind the router (KV over NIXL), send a sample request through it, and stop the fleet.
# Pass a config to try another topology: bash scripts/quickstart.sh configs/1p1d-redis.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG="${1:-configs/1p1d-nixl.yaml}"
PORT="${PORT:-8000}"
bash scripts/setup.sh
python3 scripts/make_tiny_model.py --arch llama --preset tiny --out models/tiny-llama
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}" NIXL_LOG_LEVEL="${NIXL_LOG_LEVEL:-WARN}"
LOG="$(mktemp)"
python3 scripts/launch.py "$CONFIG" --model models/tiny-llama --port "$PORT" >"$LOG" 2>&1 &
FLEET=$!
trap 'kill -TERM $FLEET 2>/dev/null; wait $FLEET 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 1 300); do
    grep -q "fleet ready" "$LOG" && break
    if ! kill -0 $FLEET 2>/dev/null; then cat "$LOG"; echo "quickstart: fleet failed" >&2; exit 1; fi
    sleep 1
done
grep "fleet ready" "$LOG"
echo "--- POST /v1/completions through the router (prefill -> KV transfer -> decode):"
curl -sS "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "tiny-llama", "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'
echo
echo "--- GET /health:"
curl -sS "http://127.0.0.1:$PORT/health"
echo
