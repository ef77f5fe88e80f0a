"""Build a model from a local HF directory and load its safetensors weights."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.engine.attention import AttentionBackend
from splitserve.engine.models.config import ModelArchConfig
from splitserve.engine.models.linear import upcast_gemms
from splitserve.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# HF name piece → (our fused parameter, index of the shard inside it)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_FUSED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")


def _shard_sizes(cfg: ModelArchConfig, fused: str) -> list[int]:
    if fused == "qkv_proj":
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


def load_model(model_dir: str | Path, cfg: ModelArchConfig, max_position: int,
               backend: AttentionBackend, dtype: torch.dtype,
               device: torch.device) -> LlamaForCausalLM:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in model directory {str(model_dir)!r}")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_position, backend)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # to_empty gives each module its own tensor: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.to(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                _load_one(params, cfg, name, f.get_tensor(name), loaded)
    missing = {n for n in params if n not in loaded}
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights: {sorted(missing)[:5]}")
    if upcast_gemms(model, dtype, device):
        logger.info("%s GEMMs run in fp32 on this CPU (no native %s matmul)", dtype, dtype)
    return model.eval()


def _load_one(params: dict[str, torch.nn.Parameter], cfg: ModelArchConfig, name: str,
              tensor: torch.Tensor, loaded: set[str]) -> None:
    if "rotary_emb" in name:
        return
    match = _FUSED_RE.search(name)
    if match is None:
        if name not in params:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                return
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        params[name].data.copy_(tensor)
        loaded.add(name)
        return
    fused, index = _FUSED[match.group(1)]
    target = name.replace(f".{match.group(1)}.", f".{fused}.")
    sizes = _shard_sizes(cfg, fused)
    start = sum(sizes[:index])
    params[target].data[start : start + sizes[index]].copy_(tensor)
    # The fused parameter counts as loaded once every shard has been seen.
    loaded.add(f"{target}#{index}")
    if all(f"{target}#{i}" in loaded for i in range(len(sizes))):
        loaded.add(target)
