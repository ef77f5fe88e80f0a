"""Attention over the block-major paged KV cache: one interface, two backends.

The batch is flat and ordered decodes first: `num_decodes` sequences with one query token each,
then prefill chunks of any length. Per layer, the backend writes the step's new K/V rows into the
cache by slot (`slot = block_id * block_size + offset`) and attends each query to its sequence's
cached context. On CUDA the Triton kernels in `splitserve.kernels` do both. On CPU, decodes go to
the C++ kernel of `splitserve.kernels.cpu` (it reads K/V where they lie in the paged cache) and
prefill chunks to `scaled_dot_product_attention`; the pure-PyTorch backend, which gathers each
sequence's blocks instead, is the fallback where the C++ kernel cannot be built, and the reference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner; shared by every layer."""

    num_decodes: int  # the first num_decodes sequences (and tokens) are single-token decodes
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_ids_of_tokens: torch.Tensor  # [num_tokens] int64: slot // block_size
    offsets_of_tokens: torch.Tensor  # [num_tokens] int64: slot % block_size
    block_tables: torch.Tensor  # [num_seqs, max_blocks], padded with 0 (int32 CUDA, int64 CPU)
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    decode_groups: list[DecodeGroup] | None = None  # CPU backend's cache, built at layer 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class DecodeGroup:
    """Decode sequences attended together on CPU, padded to the longest (`max_len`)."""

    rows: torch.Tensor | None  # their indices in the batch; None: all, in order
    table: torch.Tensor  # [n, blocks covering max_len]
    invalid: torch.Tensor  # [n, 1, 1, max_len] bool: padding past each sequence's length
    max_len: int


class AttentionBackend(ABC):
    """Writes K/V into the cache and computes attention for one layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = head_dim**-0.5

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                layer: int, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [N, L, 2, B, Hkv, D] → [T, Hq, D]."""


class TorchAttentionBackend(AttentionBackend):
    """CPU path: gather each sequence's blocks, then attention. GQA without repeating K/V.

    The cache is addressed through flat views with index_copy_/index_select, which are an order
    of magnitude faster on CPU than advanced indexing of the 6-D tensor.
    """

    def forward(self, q, k, v, kv_cache, layer, meta):
        self._write_cache(k, v, kv_cache, layer, meta)
        nd = meta.num_decodes
        if nd == meta.num_seqs:  # a pure decode step: no output buffer to copy into
            return self._decode(q, kv_cache, layer, meta)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, layer, meta)
        for s in range(nd, meta.num_seqs):
            start, end = int(meta.query_start_loc[s]), int(meta.query_start_loc[s + 1])
            out[start:end] = self._prefill(q[start:end], k[start:end], v[start:end], kv_cache,
                                           layer, meta, s)
        return out

    def _write_cache(self, k, v, kv_cache, layer, meta):
        num_blocks, num_layers, _, block_size = kv_cache.shape[:4]
        rows = kv_cache.view(-1, self.num_kv_heads * self.head_dim)  # one row per (slot, l, k/v)
        # Row of (block b, layer l, kv, offset o) = ((b * L + l) * 2 + kv) * B + o
        base = meta.block_ids_of_tokens * (num_layers * 2 * block_size) + meta.offsets_of_tokens
        k_rows = base + (layer * 2) * block_size
        rows.index_copy_(0, k_rows, k.reshape(k.shape[0], -1))
        rows.index_copy_(0, k_rows + block_size, v.reshape(v.shape[0], -1))

    def _gather(self, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor, kv: int):
        # block_table [..., n] → [..., n * B, Hkv, D]
        flat = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], 2, -1)[:, layer, kv]
        blocks = flat.index_select(0, block_table.reshape(-1))
        return blocks.view(*block_table.shape[:-1], -1, self.num_kv_heads, self.head_dim)

    def _decode(self, q, kv_cache, layer, meta):
        """Single-token queries, batched in groups of similar context length (see _groups)."""
        groups = meta.decode_groups
        if groups is None:
            groups = meta.decode_groups = self._groups(meta)
        if len(groups) == 1 and groups[0].rows is None:
            return self._decode_group(q, kv_cache, layer, groups[0])
        out = torch.empty_like(q)
        for g in groups:
            out[g.rows] = self._decode_group(q[g.rows], kv_cache, layer, g)
        return out

    def _groups(self, meta: AttentionMetadata) -> list[DecodeGroup]:
        """Each group is padded to its longest context; sorting by length and cutting a group
        when the length grows by half bounds the padding, which matters when short and long
        requests decode together (the gather and the matmuls are memory-bound). Built once per
        step, shared by every layer."""
        nd = meta.num_decodes
        lens = meta.seq_lens_cpu[:nd]
        order = sorted(range(nd), key=lens.__getitem__)
        groups, start = [], 0
        while start < nd:
            end = start + 1
            while end < nd and (lens[order[end]] <= 1.5 * lens[order[start]] or end - start < 8):
                end += 1
            whole = end - start == nd  # one group in batch order: no gather of q / scatter
            rows = None if whole else torch.tensor(order[start:end])
            max_len = lens[order[end - 1]]
            table = meta.block_tables[:nd] if whole else meta.block_tables[rows]
            seq_lens = meta.seq_lens[:nd] if whole else meta.seq_lens[rows]
            invalid = torch.arange(max_len)[None, :] >= seq_lens[:, None]  # [S, T]
            groups.append(DecodeGroup(rows, table[:, : -(-max_len // self.block_size)],
                                      invalid[:, None, None, :], max_len))
            start = end
        return groups

    def _decode_group(self, q, kv_cache, layer, g: DecodeGroup):
        n = q.shape[0]
        # [S, T, Hkv, D] → [S, Hkv, T, D]: the batched matmuls below want contiguous heads.
        keys = self._gather(kv_cache, layer, g.table, 0)[:, : g.max_len].transpose(1, 2)
        values = self._gather(kv_cache, layer, g.table, 1)[:, : g.max_len].transpose(1, 2)
        keys, values = keys.contiguous(), values.contiguous()
        group = self.num_heads // self.num_kv_heads
        # The query heads of one KV head act as that head's "query length": [S, Hkv, G, D].
        qg = q.view(n, self.num_kv_heads, group, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float()  # [S, Hkv, G, T]
        scores.masked_fill_(g.invalid, float("-inf"))
        probs = torch.softmax(scores.mul_(self.scale), dim=-1).to(q.dtype)
        o = torch.matmul(probs, values)  # [S, Hkv, G, D]
        return o.reshape(n, self.num_heads, self.head_dim)

    def _prefill(self, q, k, v, kv_cache, layer, meta, s):
        query_len, seq_len = meta.query_lens_cpu[s], meta.seq_lens_cpu[s]
        if query_len == seq_len:  # nothing cached before this chunk: attend to the fresh K/V
            keys, values, mask, causal = k, v, None, True
        else:
            table = meta.block_tables[s, : -(-seq_len // self.block_size)]
            keys = self._gather(kv_cache, layer, table, 0)[:seq_len]
            values = self._gather(kv_cache, layer, table, 1)[:seq_len]
            # Query i sits at position seq_len - query_len + i and sees positions <= that.
            pos_q = torch.arange(seq_len - query_len, seq_len)[:, None]
            mask, causal = torch.arange(seq_len)[None, :] <= pos_q, False
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1)


class CpuAttentionBackend(TorchAttentionBackend):
    """CPU path with the C++ paged decode kernel; prefill chunks as in the PyTorch backend.

    bf16/fp16 prefill runs SDPA in fp32: on CPUs without native 16-bit matmul (AVX2) that is an
    order of magnitude faster, and SDPA accumulates in fp32 either way.
    """

    def _prefill(self, q, k, v, kv_cache, layer, meta, s):
        """A chunk after cached context: attend to the cached prefix (no mask) and to the chunk
        itself (causal) separately, then merge the two by their log-sum-exp.

        One SDPA call over the whole context needs an explicit [query, context] mask, which
        sends CPU flash attention down its masked path: with 2048 queries over 2600 positions
        that took 131 ms against 71 ms split in two (head_dim 32, one thread). The chunk's own
        K/V are used as computed; only the prefix is gathered from the cache.
        """
        query_len, seq_len = meta.query_lens_cpu[s], meta.seq_lens_cpu[s]
        if query_len == seq_len:
            return super()._prefill(q, k, v, kv_cache, layer, meta, s)
        cached = seq_len - query_len
        table = meta.block_tables[s, : -(-cached // self.block_size)]
        keys = self._gather(kv_cache, layer, table, 0)[:cached]
        values = self._gather(kv_cache, layer, table, 1)[:cached]
        qh = q.transpose(0, 1)[None]
        o_pre, lse_pre = _flash_cpu(qh, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                    False, scale=self.scale)
        o_new, lse_new = _flash_cpu(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], True,
                                    scale=self.scale)
        # softmax over both parts = each part's softmax weighted by its share of the total mass
        w_pre = torch.sigmoid(lse_pre - lse_new)[..., None]  # [1, Hq, query_len, 1]
        o = torch.lerp(o_new.float(), o_pre.float(), w_pre)
        return o[0].transpose(0, 1).to(q.dtype)

    def _decode(self, q, kv_cache, layer, meta):
        from splitserve.kernels import cpu

        return cpu.paged_decode_attention(q, kv_cache[:, layer, 0], kv_cache[:, layer, 1],
                                          meta.block_tables[: q.shape[0]],
                                          meta.seq_lens[: q.shape[0]], self.scale)


def _flash_cpu(q, k, v, causal: bool, scale: float):
    """PyTorch's CPU flash attention, which returns the log-sum-exp the public SDPA drops.
    [1, H, L, D] layout; GQA by head broadcast (Hq a multiple of Hkv); lse is fp32 [1, Hq, Lq]."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                      scale=scale)


class TritonAttentionBackend(AttentionBackend):
    """CUDA path: our Triton kernels (see kernels/)."""

    def forward(self, q, k, v, kv_cache, layer, meta):
        from splitserve import kernels

        k_cache, v_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
        kernels.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = kernels.paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], self.scale)
        if nd < meta.num_seqs:
            qsl = meta.query_start_loc[nd:] - meta.query_start_loc[nd]
            out[nd:] = kernels.paged_prefill_attention(
                q[nd:], k_cache, v_cache, meta.block_tables[nd:], qsl.to(torch.int32),
                meta.seq_lens[nd:], self.scale)
        return out


def make_attention_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int,
                           head_dim: int, block_size: int) -> AttentionBackend:
    """`auto` → Triton on CUDA; on CPU the C++ kernel (`cpu`) if it builds, else PyTorch (`torch`)."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            from splitserve.kernels import cpu

            name = "cpu" if cpu.available() else "torch"
    if name == "cpu":
        from splitserve.kernels import cpu

        if device.type != "cpu":
            raise ValueError("attention_backend 'cpu' runs on the CPU only (device is "
                             f"{device.type})")
        if not cpu.available():
            raise ValueError("attention_backend 'cpu' needs its C++ kernels, which did not build "
                             "(a C++ compiler and ninja are required); use 'torch'")
        return CpuAttentionBackend(num_heads, num_kv_heads, head_dim, block_size)
    if name == "triton":
        from splitserve.kernels import triton_available

        if not triton_available():
            raise ValueError("attention_backend 'triton' needs the triton package "
                             "(pip install 'splitserve[gpu]')")
        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, block_size)
    if name == "torch":
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, block_size)
    raise ValueError(f"unknown attention_backend {name!r} (known: auto, cpu, torch, triton)")
