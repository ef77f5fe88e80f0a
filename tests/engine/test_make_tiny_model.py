"""Tests of scripts/make_tiny_model.py: the offline, seeded HF model directories tests build on."""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitserve.scripts import make_tiny_model as mtm
from splitserve.scripts.make_tiny_model import make_model

ARCHS = ("llama", "qwen2", "qwen3")
# Parameter counts of the tiny preset: llama has an untied LM head (+8192 * 256).
PARAM_RANGE = {"llama": (7.0e6, 7.3e6), "qwen2": (5.0e6, 5.1e6), "qwen3": (5.0e6, 5.1e6)}


@pytest.fixture(scope="module", autouse=True)
def _tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the trained-tokenizer cache inside the test's tmp dir, not in ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny bf16 model directory per arch, built once for the module."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch=arch, seed=0) for arch in ARCHS}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_loads_model_with_expected_shape(models: dict[str, Path], arch: str) -> None:
    d = models[arch]
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == [mtm._HF_ARCH[arch]]
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["vocab_size"] == 8192 == len(AutoTokenizer.from_pretrained(d))
    assert cfg["eos_token_id"] == cfg["bos_token_id"] == 0
    lo, hi = PARAM_RANGE[arch]
    n = model.num_parameters()
    assert lo <= n <= hi
    assert json.loads((d / mtm.STAMP_FILE).read_text())["num_parameters"] == n
    params = dict(model.named_parameters())
    assert ("model.layers.0.self_attn.q_proj.bias" in params) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in params) == (arch == "qwen3")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (arch != "llama")
    # Norm weights and biases must not be HF's defaults (ones / zeros), or engine code paths
    # that mishandle them would still match HF.
    assert not torch.all(params["model.layers.0.input_layernorm.weight"] == 1)
    if arch == "qwen2":
        assert params["model.layers.0.self_attn.k_proj.bias"].abs().min() > 0
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 8192)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_logits_have_clear_winners(models: dict[str, Path], arch: str) -> None:
    """The property engine-vs-HF parity tests rely on: argmax is not decided by rounding."""
    d = models[arch]
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    gaps: list[float] = []
    for prompt in ("def fibonacci(n):\n    ", "Once upon a time, in a land far away"):
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids,
            max_new_tokens=16,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=None,
        )
        top2 = torch.cat(out.logits).topk(2, dim=-1).values  # [steps, 2]
        gaps.extend((top2[:, 0] - top2[:, 1]).tolist())
        new = out.sequences[0, ids.shape[1] :].tolist()
        assert len(set(new[:4])) > 1, f"greedy output collapsed at once: {new}"
    assert statistics.median(gaps) > 0.05
    assert min(gaps) > 1e-4


def test_tokenizer_round_trips_and_renders_chat(models: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(models["qwen3"])
    text = "Grüße, 世界! 🎉 naïve café\n\tx = {'a': 1}  "
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert ids[0] != tok.eos_token_id  # no BOS is prepended
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_prompt == rendered.removesuffix("<|im_start|>assistant\n")
    chat_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert chat_ids == tok(rendered).input_ids
    assert chat_ids.count(1) == 3  # <|im_start|> stays one special token


def test_tokenizer_training_is_deterministic(models: dict[str, Path]) -> None:
    """Training again, bypassing the cache, reproduces the shipped tokenizer.json exactly."""
    retrained = mtm._train_bpe(mtm._read_corpus(), 8192)
    assert retrained == (models["llama"] / "tokenizer.json").read_text(encoding="utf-8")


def test_same_seed_is_byte_identical_and_seeds_differ(
    models: dict[str, Path], tmp_path: Path
) -> None:
    again = make_model(tmp_path / "again", arch="qwen2", seed=0)
    other = make_model(tmp_path / "other", arch="qwen2", seed=1)
    ref = models["qwen2"]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(again / name) == _sha(ref / name), name
    assert _sha(other / "model.safetensors") != _sha(ref / "model.safetensors")
    assert _sha(other / "tokenizer.json") == _sha(ref / "tokenizer.json")


def test_existing_model_is_reused_and_options_change_rebuilds(tmp_path: Path) -> None:
    out = tmp_path / "m"
    make_model(out, arch="llama", dtype="float32")
    weights = out / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert make_model(out, arch="llama", dtype="float32") == out.resolve()
    assert weights.stat().st_mtime_ns == mtime
    make_model(out, arch="llama", dtype="float16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    assert json.loads((out / mtm.STAMP_FILE).read_text())["options"]["dtype"] == "float16"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_refuses_to_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="force"):
        make_model(tmp_path, arch="llama")
    assert (tmp_path / "notes.txt").exists()


def test_cli_prints_one_line_and_skips_when_current(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--arch", "qwen3", "--dtype", "float32", "--out", str(tmp_path / "cli")]
    assert mtm.main(argv) == 0
    assert mtm.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("wrote ") and "M parameters" in lines[0]
    assert lines[1].startswith("exists ") and str(tmp_path / "cli") in lines[1]


def test_small_preset_config_without_building() -> None:
    cfg = mtm.model_config("qwen2", "small")
    assert cfg["vocab_size"] == 32000
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (
        896,
        24,
        4864,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (14, 2, 64)
    assert cfg["rope_theta"] == 1e6 and cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True
    with torch.device("meta"):  # shapes only: no memory, no init
        model = AutoModelForCausalLM.from_config(mtm.hf_config(cfg))
    assert 3.5e8 < model.num_parameters() < 4.0e8


def test_rope_scaling_llama3_and_option_errors() -> None:
    cfg = mtm.model_config("llama", "tiny", rope_scaling="llama3")
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    assert mtm.hf_config(cfg).rope_parameters["rope_type"] == "llama3"
    assert mtm.model_config("llama")["rope_scaling"] is None
    with pytest.raises(ValueError, match="needs arch 'llama'"):
        mtm.model_config("qwen2", rope_scaling="llama3")
    with pytest.raises(ValueError, match="known: llama, qwen2, qwen3"):
        mtm.model_config("mistral")
