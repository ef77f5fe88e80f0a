"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) on the paged attention backend.

One module covers the family; the differences are flags in ModelArchConfig: Qwen2 adds a bias to
q/k/v, Qwen3 normalizes q and k per head, small Qwen models tie the LM head to the embedding.
Weights keep HF's names except two fusions that halve the number of matmuls on the hot path:
q/k/v → `qkv_proj` and gate/up → `gate_up_proj` (see loader.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.models.config import ModelArchConfig
from splitserve.engine.models.linear import Linear
from splitserve.engine.models.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    """HF's formula exactly (normalize in fp32, scale in the input dtype) for parity."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer: int, rotary: RotaryEmbedding,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.backend = backend

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = self.backend.forward(q, k, v, kv_cache, self.layer, meta)  # [T, Hq, D]
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer: int, rotary: RotaryEmbedding,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, rotary, backend)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, kv_cache, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_position: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.rotary = rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta,
                                               cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, rotary, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_cache, meta):
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            x = layer(positions, x, kv_cache, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_position: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_position, backend)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Flat batch: input_ids/positions [T] → hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [S, vocab], fp32 for the sampler
