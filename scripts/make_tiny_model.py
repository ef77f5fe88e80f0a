"""Write a small random-weight HF model directory, offline and deterministic for a seed.

The directory holds everything `transformers` and our engine read: `config.json`,
`model.safetensors`, `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`, plus a `splitserve_model.json` stamp that records the options it was
built with, so a second call with the same options returns at once (the README's main command
calls this on every run).

Two things are not what a plain `from_config` would give, on purpose:

* The tokenizer is a byte-level BPE trained here on the Python standard library's own sources,
  the one text corpus every machine has. Files are taken in sorted order up to a byte budget, so
  the same Python and `tokenizers` versions always give the same `tokenizer.json`; the result is
  cached per training-input hash because the README command rebuilds often.
* The weights are re-drawn with our own generator instead of HF's std-0.02 init. That init gives
  near-flat logits whose top-1/top-2 gaps are so small that fp32 rounding differences between two
  correct implementations flip the greedy argmax, which breaks token-for-token parity tests. See
  `_fill_weights` for the scheme.

Usage:
    python scripts/make_tiny_model.py --arch qwen3 --preset tiny --out models/tiny-qwen3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ARCHS = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_SCALINGS = ("llama3",)
STAMP_FILE = "splitserve_model.json"
# Bump when the output for the same options changes (init scheme, file layout, corpus rules).
FORMAT_VERSION = 1
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ~8 MB of stdlib source: enough for a 32k vocab, trains in about 2 s on one core.
CORPUS_BYTE_BUDGET = 8_000_000
_CORPUS_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "idle_test", "tests"}

_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


@dataclass(frozen=True)
class Preset:
    """Model shape; `small` is roughly Qwen2.5-0.5B, `tiny` builds in seconds on a CPU."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float


PRESETS: dict[str, Preset] = {
    "tiny": Preset(8192, 256, 4, 8, 4, 32, 704, 4096, 10000.0),
    "small": Preset(32000, 896, 24, 14, 2, 64, 4864, 8192, 1000000.0),
}


@dataclass(frozen=True)
class BuildOptions:
    """Everything that determines the output bytes; stored in the stamp file."""

    arch: str
    preset: str
    dtype: str
    seed: int
    rope_scaling: str | None

    def validate(self) -> None:
        """Reject unknown option values with a message naming the known ones."""
        _check_choice("arch", self.arch, ARCHS)
        _check_choice("preset", self.preset, tuple(PRESETS))
        _check_choice("dtype", self.dtype, DTYPES)
        if self.rope_scaling is not None:
            _check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
            if self.arch != "llama":
                raise ValueError(f"rope_scaling={self.rope_scaling!r} needs arch 'llama'")

    def stamp(self) -> dict[str, Any]:
        """The stamp-file content that identifies a build with these options."""
        return {"format_version": FORMAT_VERSION, **asdict(self)}


def _check_choice(name: str, value: object, known: tuple[str, ...]) -> None:
    if value not in known:
        raise ValueError(f"unknown {name} {value!r} (known: {', '.join(known)})")


# --------------------------------------------------------------------------- config


def model_config(
    arch: str = "llama",
    preset: str = "tiny",
    dtype: str = "bfloat16",
    rope_scaling: str | None = None,
) -> dict[str, Any]:
    """The `config.json` dict a build with these options writes (no weights, no tokenizer).

    Written in the classic Hub layout (`rope_theta`, `rope_scaling`, `torch_dtype`) that real
    Llama/Qwen checkpoints use; current `transformers` reads it and converts internally. The
    special-token ids are fixed by `SPECIAL_TOKENS` order, since the BPE trainer puts special
    tokens first.
    """
    BuildOptions(arch, preset, dtype, 0, rope_scaling).validate()
    p = PRESETS[preset]
    eos_id = SPECIAL_TOKENS.index(EOS_TOKEN)
    cfg: dict[str, Any] = {
        "architectures": [_HF_ARCH[arch]],
        "model_type": arch,
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": p.rope_theta,
        "rope_scaling": dict(_LLAMA3_ROPE_SCALING) if rope_scaling == "llama3" else None,
        "tie_word_embeddings": arch != "llama",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,  # HF's default; our weights are drawn by `_fill_weights`
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:  # qwen2 has q/k/v biases hard-wired in HF; qwen3 has none
        cfg.update(use_sliding_window=False, sliding_window=None)
        cfg["max_window_layers"] = p.num_hidden_layers
        if arch == "qwen3":
            cfg["attention_bias"] = False
    return cfg


# --------------------------------------------------------------------------- tokenizer


def _corpus_files(root: Path) -> list[str]:
    """Relative posix paths of stdlib `.py` files, sorted, skipping tests and third-party code."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if d not in _CORPUS_SKIP_DIRS and not d.startswith("test")
        ]
        rel = Path(dirpath).relative_to(root)
        found.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(found)


def _read_corpus(budget: int = CORPUS_BYTE_BUDGET) -> list[tuple[str, bytes]]:
    """(relative path, bytes) of stdlib sources in sorted order until `budget` bytes are used."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[tuple[str, bytes]] = []
    used = 0
    for rel in _corpus_files(root):
        data = (root / rel).read_bytes()
        if used + len(data) > budget:
            break
        docs.append((rel, data))
        used += len(data)
    if not docs:
        raise RuntimeError(f"no Python sources found under {root} to train the tokenizer on")
    return docs


def _tokenizer_cache_dir() -> Path:
    """`$SPLITSERVE_CACHE_DIR/tokenizers`, else `$XDG_CACHE_HOME` or `~/.cache`/splitserve."""
    base = os.environ.get("SPLITSERVE_CACHE_DIR")
    if base is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = os.path.join(xdg, "splitserve")
    return Path(base) / "tokenizers"


def _training_key(docs: list[tuple[str, bytes]], vocab_size: int) -> str:
    """Hash of everything the trained tokenizer depends on, to key the cache."""
    import tokenizers

    h = hashlib.sha256()
    h.update(f"v{FORMAT_VERSION}|tokenizers={tokenizers.__version__}|vocab={vocab_size}|".encode())
    h.update("|".join(SPECIAL_TOKENS).encode())
    for rel, data in docs:
        h.update(f"|{rel}|{len(data)}|".encode())
        h.update(data)
    return h.hexdigest()


def _train_bpe(docs: list[tuple[str, bytes]], vocab_size: int) -> str:
    """Train the byte-level BPE and return its `tokenizer.json` text.

    No normalizer, ByteLevel pre-tokenizer and decoder: every string, unicode included,
    round-trips exactly. No post-processor template, so no BOS is prepended (like Qwen).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((data.decode("utf-8", errors="replace") for _, data in docs), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"BPE reached {tok.get_vocab_size()} tokens, not {vocab_size}: "
            f"raise CORPUS_BYTE_BUDGET ({CORPUS_BYTE_BUDGET})"
        )
    return tok.to_str(pretty=True)


def tokenizer_json(vocab_size: int) -> str:
    """`tokenizer.json` text for `vocab_size`, from the cache when the training inputs match."""
    docs = _read_corpus()
    path = _tokenizer_cache_dir() / f"bpe-{vocab_size}-{_training_key(docs, vocab_size)[:24]}.json"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    text = _train_bpe(docs, vocab_size)
    try:  # the cache is an optimisation: a read-only home must not fail the build
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not cache tokenizer at %s: %s", path, exc)
    return text


def _write_tokenizer_files(out: Path, vocab_size: int, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out`."""
    (out / "tokenizer.json").write_text(tokenizer_json(vocab_size), encoding="utf-8")
    extra = list(SPECIAL_TOKENS[1:])
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "additional_special_tokens": extra,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    special = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "additional_special_tokens": extra}
    _write_json(out / "tokenizer_config.json", tok_cfg)
    _write_json(out / "special_tokens_map.json", special)


# --------------------------------------------------------------------------- weights

# Target std of the final logits. Greedy top-1/top-2 gaps of N Gaussian logits scale like
# std / sqrt(2 ln N), so std 4 gives gaps of order 1 and near-ties (< 1e-4) around 1e-4 of steps.
_LOGIT_STD = 4.0
# Input embeddings (and, tied, the LM head) are small next to the O(1) block outputs, so the final
# hidden state is not dominated by the current token's own embedding; otherwise a tied model just
# predicts its input token again.
_EMBED_STD = 0.02
# Queries are drawn this much larger than keys, so attention scores have std ~3 and each head
# attends to a few positions. With std-1 scores attention averages the whole context, the newest
# token barely moves the hidden state, and greedy output repeats one token from the first steps.
_QUERY_GAIN = 3.0
_BIAS_STD = 0.1
_NORM_JITTER = 0.2  # norm weights ~ U(1 - j, 1 + j): not all ones, so a missing norm shows


def _init_scale(name: str, shape: tuple[int, ...], cfg: dict[str, Any]) -> tuple[str, float]:
    """("normal", std) or ("uniform-around-1", scale) for one parameter, by its HF name."""
    # qwen3 normalises q per head, so its query gain has to sit in q_norm, not in q_proj.
    if cfg["model_type"] == "qwen3":
        query_gain = _QUERY_GAIN if name.endswith("q_norm.weight") else 1.0
    else:
        query_gain = _QUERY_GAIN if ".q_proj." in name else 1.0
    if name.endswith("norm.weight"):
        if name == "model.norm.weight":  # sets the logit scale, see _LOGIT_STD
            return "uniform-around-1", _LOGIT_STD / (math.sqrt(cfg["hidden_size"]) * _EMBED_STD)
        return "uniform-around-1", query_gain
    if name.endswith(".bias"):
        return "normal", _BIAS_STD * query_gain
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "normal", _EMBED_STD
    if name.endswith("_proj.weight"):  # std 1/sqrt(fan_in) keeps activations O(1)
        return "normal", query_gain / math.sqrt(shape[1])
    raise RuntimeError(f"no init rule for parameter {name!r} {shape}")


def _fill_weights(params: dict[str, Any], cfg: dict[str, Any], seed: int) -> None:
    """Re-draw every parameter in place, in sorted-name order, from one seeded generator.

    Drawing by sorted name (rather than relying on HF's init order) keeps the bytes stable across
    `transformers` versions. See `_init_scale` for the distribution of each tensor.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in sorted(params):
            t = params[name]
            kind, scale = _init_scale(name, tuple(t.shape), cfg)
            if kind == "normal":
                t.normal_(0.0, scale, generator=gen)
            else:
                t.uniform_(1.0 - _NORM_JITTER, 1.0 + _NORM_JITTER, generator=gen).mul_(scale)


def hf_config(cfg: dict[str, Any]) -> Any:
    """The `transformers` config object for a `model_config` dict (dtype left to the caller)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "torch_dtype"})


def build_hf_model(cfg: dict[str, Any], seed: int) -> Any:
    """An fp32 HF `*ForCausalLM` for `cfg` with our deterministic weights (see `_fill_weights`)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.float32)
    # named_parameters() lists a tied tensor once, under the embedding's name.
    _fill_weights(dict(model.named_parameters()), cfg, seed)
    return model.eval()


def _save_weights(model: Any, cfg: dict[str, Any], path: Path) -> int:
    """Write `model.safetensors` in the config's dtype; return the parameter count."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, cfg["torch_dtype"])
    state = model.state_dict()
    if cfg["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)  # HF checkpoints store a tied head only once
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- directory


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_stamp(out: str | Path) -> dict[str, Any] | None:
    """The stamp of a complete model directory, or None if `out` is not one."""
    out = Path(out)
    if not all((out / f).is_file() for f in (*MODEL_FILES, STAMP_FILE)):
        return None
    try:
        return json.loads((out / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _make_readable(d: Path) -> None:
    """Give `d` and its files the usual 755/644 modes (mkdtemp and safetensors make them private)."""
    d.chmod(0o755)
    for f in d.iterdir():
        f.chmod(0o644)


def _is_current(out: Path, opts: BuildOptions) -> bool:
    stamp = read_stamp(out)
    return stamp is not None and stamp.get("options") == opts.stamp()


def _write_model_dir(tmp: Path, opts: BuildOptions) -> None:
    """Write every file of the model directory into the empty directory `tmp`."""
    cfg = model_config(opts.arch, opts.preset, opts.dtype, opts.rope_scaling)
    _write_tokenizer_files(tmp, cfg["vocab_size"], cfg["max_position_embeddings"])
    model = build_hf_model(cfg, opts.seed)
    n_params = _save_weights(model, cfg, tmp / "model.safetensors")
    _write_json(tmp / "config.json", cfg)
    gen_cfg = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(tmp / "generation_config.json", {**gen_cfg, "do_sample": False})
    _write_json(tmp / STAMP_FILE, {"options": opts.stamp(), "num_parameters": n_params})


def make_model(
    out: str | Path,
    arch: str = "llama",
    preset: str = "tiny",
    dtype: str = "bfloat16",
    seed: int = 0,
    rope_scaling: str | None = None,
    force: bool = False,
) -> Path:
    """Build the model directory `out` and return its path; reuse it if already built alike.

    The files are written to a sibling temp directory and renamed into place, so an interrupted
    or concurrent build never leaves a half-written directory that looks complete. A non-empty
    `out` without our stamp is someone else's directory: it is only replaced with `force`.
    """
    opts = BuildOptions(arch, preset, dtype, seed, rope_scaling)
    opts.validate()
    out = Path(out).resolve()
    if not force and _is_current(out, opts):
        return out
    if out.exists() and not force and read_stamp(out) is None and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a splitserve model dir; pass force=True")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_model_dir(tmp, opts)
        _make_readable(tmp)
        if out.exists():
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:  # a concurrent build of the same options got there first
            if not _is_current(out, opts):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote %s (%s)", out, opts)
    return out


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    ap.add_argument("--preset", choices=tuple(PRESETS), default="tiny")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="model directory to write")
    ap.add_argument("--rope-scaling", choices=ROPE_SCALINGS, default=None, help="llama only")
    ap.add_argument("--force", action="store_true", help="rebuild even if DIR is up to date")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints one line with the model path and its parameter count."""
    args = _parse_args(argv)
    opts = BuildOptions(args.arch, args.preset, args.dtype, args.seed, args.rope_scaling)
    try:
        opts.validate()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    existed = not args.force and _is_current(out, opts)
    make_model(out, **asdict(opts), force=args.force)
    stamp = read_stamp(out) or {}
    n = stamp.get("num_parameters", 0)
    verb = "exists" if existed else "wrote"
    print(f"{verb} {out} ({args.arch}/{args.preset}/{args.dtype}, {n / 1e6:.2f}M parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
