"""Flat batch inputs, the forward pass and sampling for one engine step.

A step's tokens are laid out flat, sequence after sequence, decodes first:

```
input_ids     | d0 | d1 | d2 | p0 p0 p0 p0 p0 | p1 p1 p1 |
positions     | 37 | 12 | 90 |  0  1  2  3  4 | 16 17 18 |   (p1: a later chunk of its prompt)
slot_mapping  | block_table[pos // block_size] * block_size + pos % block_size |
```
Only the last token of a sequence whose chunk reaches its end is sampled (`logits_indices`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from splitserve.engine.attention import (
    AttentionMetadata,
    TritonAttentionBackend,
    make_attention_backend,
)
from splitserve.engine.config import EngineConfig
from splitserve.engine.cpu_memory import empty_on_huge_pages, tune_cpu_allocator
from splitserve.engine.models.config import ModelArchConfig
from splitserve.engine.models.loader import load_model
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from splitserve.kv_connector.layout import cdiv

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, arch: ModelArchConfig) -> torch.dtype:
    name = arch.torch_dtype.removeprefix("torch.") if requested == "auto" else requested
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (supported: {', '.join(_DTYPES)})")
    return _DTYPES[name]


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArchConfig, max_model_len: int) -> None:
        self.config = config
        self.arch = arch
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.model.dtype, arch)
        self.block_size = config.cache.block_size
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            tune_cpu_allocator()
        backend = make_attention_backend(config.attention_backend, self.device, arch.num_heads,
                                         arch.num_kv_heads, arch.head_dim, self.block_size)
        self.uses_triton = isinstance(backend, TritonAttentionBackend)
        self.model = load_model(config.model.model, arch, max_model_len, backend, self.dtype,
                                self.device)
        self.num_blocks = self._num_blocks(max_model_len)
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]: one block holds every
        # layer's K and V contiguously, so a transfer moves one region per block.
        # Written explicitly (not torch.zeros, which on CPU maps pages lazily): the budget is
        # committed at start, and the first requests do not pay a page fault per page.
        shape = (self.num_blocks, arch.num_layers, 2, self.block_size, arch.num_kv_heads,
                 arch.head_dim)
        if self.device.type == "cpu":
            self.kv_cache = empty_on_huge_pages(shape, self.dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.sampler = Sampler(arch.vocab_size, config.seed)
        logger.info("model %s on %s (%s): %d KV blocks of %d tokens (%.1f MiB)",
                    arch.architecture, self.device, self.dtype, self.num_blocks, self.block_size,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)

    @property
    def block_nbytes(self) -> int:
        a = self.arch
        return (a.num_layers * 2 * self.block_size * a.num_kv_heads * a.head_dim
                * torch.finfo(self.dtype).bits // 8)

    def _num_blocks(self, max_model_len: int) -> int:
        cache = self.config.cache
        num_blocks = cache.num_blocks or cache.kv_cache_memory // self.block_nbytes
        needed = cdiv(max_model_len, self.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"KV cache budget too small for one sequence: {num_blocks} blocks x "
                f"{self.block_size} tokens < max_model_len {max_model_len} (needs {needed} blocks "
                f"of {self.block_nbytes} bytes); raise kv_cache_memory or lower max_model_len")
        return num_blocks

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        batch = sorted(out.scheduled, key=lambda s: s.num_tokens != 1 or not s.samples)
        input_ids, positions, meta, logits_indices = self._prepare_inputs(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)  # [T, hidden]
        sampling = [s for s in batch if s.samples]
        if not sampling:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden[logits_indices])  # [S, vocab]
        requests = [s.request for s in sampling]
        tokens, logprobs = self.sampler(logits, requests)
        ids = [r.request_id for r in requests]
        return ModelRunnerOutput(
            dict(zip(ids, tokens, strict=True)),
            {rid: lp for rid, lp in zip(ids, logprobs, strict=True) if lp is not None})

    def _prepare_inputs(self, batch: list[ScheduledRequest]):
        bs = self.block_size
        query_lens = [s.num_tokens for s in batch]
        seq_lens = [s.num_computed_tokens + s.num_tokens for s in batch]
        max_blocks = max(cdiv(n, bs) for n in seq_lens)
        # int32 for the Triton kernels; int64 on CPU, where index_select is 5x faster with it.
        table_dtype = np.int32 if self.uses_triton else np.int64
        block_tables = np.zeros((len(batch), max_blocks), dtype=table_dtype)
        ids: list[int] = []
        for i, s in enumerate(batch):
            block_tables[i, : cdiv(seq_lens[i], bs)] = s.block_ids[: cdiv(seq_lens[i], bs)]
            if s.num_tokens == 1:
                ids.append(s.request.all_token_ids[s.num_computed_tokens])
            else:
                ids.extend(s.request.all_token_ids[s.num_computed_tokens : seq_lens[i]])
        query_start = np.zeros(len(batch) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        seq_index = np.repeat(np.arange(len(batch)), query_lens)
        computed = np.asarray(seq_lens, dtype=np.int64) - np.asarray(query_lens, dtype=np.int64)
        positions = computed[seq_index] + (np.arange(len(ids)) - query_start[seq_index])
        block_ids = block_tables[seq_index, positions // bs].astype(np.int64)
        offsets = positions % bs
        num_decodes = sum(1 for s in batch if s.num_tokens == 1 and s.samples)
        dev = self.device
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            slot_mapping=torch.from_numpy(block_ids * bs + offsets).to(dev),
            block_ids_of_tokens=torch.from_numpy(block_ids).to(dev),
            offsets_of_tokens=torch.from_numpy(offsets).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.from_numpy(query_start).to(dev),
            seq_lens_cpu=seq_lens, query_lens_cpu=query_lens)
        logits_indices = torch.tensor(
            [query_start[i + 1] - 1 for i, s in enumerate(batch) if s.samples], device=dev)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return input_ids, torch.from_numpy(positions).to(dev), meta, logits_indices
