"""Rotary position embeddings (neox style, as HF Llama), with llama3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's piecewise scaling: long wavelengths slowed by `factor`, short ones kept."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position, computed once in fp32 on the CPU.

    A plain object, not an nn.Module: the tables are not weights, and the model is built on the
    meta device, where module buffers would be left uninitialized.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu)
                                    .float() / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: llama3)")
        positions = torch.arange(max_position, dtype=torch.float32, device=cpu)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.cos_cache, self.sin_cache = emb.cos(), emb.sin()

        self._typed: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.cos_cache, self.sin_cache = self.cos_cache.to(device), self.sin_cache.to(device)
        self._typed.clear()
        return self

    def _tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # HF casts cos/sin to the activation dtype before use; cast once, keep one half.
        if dtype not in self._typed:
            half = self.cos_cache.shape[-1] // 2
            self._typed[dtype] = (self.cos_cache[:, :half].to(dtype).contiguous(),
                                  self.sin_cache[:, :half].to(dtype).contiguous())
        return self._typed[dtype]

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, Hq, D], k [T, Hkv, D] → rotated q, k.

        `x * cos + rotate_half(x) * sin` written on the two halves; element for element the same
        floating-point operations as HF's form, so fp32 results are bit-identical.
        """
        cos_t, sin_t = self._tables(q.dtype)
        cos = cos_t[positions][:, None, :]  # [T, 1, D/2]
        sin = sin_t[positions][:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
