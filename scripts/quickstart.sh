#!/usr/bin/env bash
# The main command (README): install, make the tiny model, run an offline generation on it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 scripts/make_tiny_model.py --arch llama --preset tiny --out models/tiny-llama
python3 - <<'PY'
from splitserve import LLM, SamplingParams

llm = LLM(model="models/tiny-llama", kv_cache_memory="256MiB")
prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Server:"]
params = SamplingParams(temperature=0.0, max_tokens=32)
for out in llm.generate(prompts, params, use_tqdm=False):
    print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
PY
