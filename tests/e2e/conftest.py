"""E2E fixtures; the fleet helpers the tests share live in fleet_helpers.py (a plain module, so
`from fleet_helpers import …` finds them whichever conftest pytest loaded last)."""

from __future__ import annotations

import pytest
from fleet_helpers import PROMPTS


@pytest.fixture(scope="session")
def reference(llama_fp32: str) -> dict:
    """Offline `LLM.generate` greedy outputs: what every topology must reproduce."""
    from splitserve import LLM, SamplingParams

    llm = LLM(model=llama_fp32, kv_cache_memory="64MiB", num_threads=1)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    result = {p: o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}
    del llm
    return result
