"""Bad input raises ValueError naming the problem, and nothing is left allocated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from testutil import assert_all_blocks_free

from splitserve import LLM, SamplingParams
from splitserve.engine.config import EngineConfig, parse_bytes


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"min_p": 2.0}, "min_p"),
    ({"top_k": -5}, "top_k"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": 50}, "logprobs"),
    ({"n": 0}, "n must be >= 1"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_longer_than_max_model_len(llama_fp32):
    llm = LLM(model=llama_fp32, max_model_len=64, kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="longer than max_model_len 64"):
        llm.generate([{"prompt_token_ids": [1] * 10}, {"prompt_token_ids": [1] * 80}],
                     use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate({"prompt_token_ids": [10**7]}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    assert_all_blocks_free(llm.stats())
    assert llm.stats()["running"] == 0 and llm.stats()["waiting"] == 0  # nothing was queued
    assert len(llm.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)) == 1


def test_missing_model_dir(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(model=str(tmp_path / "nope"))


def test_unsupported_architecture(tmp_path, llama_fp32):
    src = Path(llama_fp32)
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        shutil.copy(src / name, tmp_path / name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(model=str(tmp_path))


def test_kv_budget_too_small(llama_fp32):
    with pytest.raises(ValueError, match="KV cache budget too small"):
        LLM(model=llama_fp32, kv_cache_memory="64KiB", max_model_len=2048)


def test_config_errors_name_the_field(llama_fp32):
    with pytest.raises(ValueError, match="cache.block_size"):
        EngineConfig.from_flat(model=llama_fp32, block_size=3)
    with pytest.raises(ValueError, match="scheduler.max_num_seqs"):
        EngineConfig.from_flat(model=llama_fp32, max_num_seqs=0)
    with pytest.raises(ValueError, match="unknown engine argument 'blok_size'"):
        EngineConfig.from_flat(model=llama_fp32, blok_size=16)
    with pytest.raises(ValueError, match="cannot parse"):
        EngineConfig.from_flat(model=llama_fp32, kv_cache_memory="lots")
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1.5GiB") == 3 * 2**29
