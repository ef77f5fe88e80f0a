"""The engine end to end on the Triton attention backend equals the PyTorch backend.

On CPU the kernels run in the Triton interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET),
natively on CUDA. A token budget of 24 forces chunked prefill over a cached prefix, and the
prompts cover 1 token, exactly one block, and several blocks.
"""

from __future__ import annotations

import pytest
from testutil import tiny_model_dir

from splitserve import LLM, SamplingParams


def test_greedy_equal_on_triton_and_torch_backends():
    pytest.importorskip("triton")
    model = tiny_model_dir("llama", "float32")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 16, 37)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    common = dict(kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=24)
    ref = LLM(model=model, attention_backend="torch", **common).generate(prompts, params,
                                                                         use_tqdm=False)
    llm = LLM(model=model, attention_backend="triton", **common)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
