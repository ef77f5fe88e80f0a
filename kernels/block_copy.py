"""Whole-block copies of the KV cache: pack to a staging buffer, unpack from it, block to block.

    kv_cache : [num_blocks, num_layers, 2, block_size, Hkv, D], contiguous
    block    : kv_cache[b], one contiguous run of block_numel = num_layers * 2 * block_size * Hkv * D
    staging  : [n, block_numel], contiguous, kv_cache's dtype; row i holds block block_ids[i]

The block-major layout makes a block one flat run, so every operation is the same gather/scatter of
rows: program (i, c) moves chunk c (16 KiB) of row i from `src[src_row(i)]` to `dst[dst_row(i)]`,
where a row index comes from an id list or is i itself. Elements are moved as same-width integers,
so the copy is bit-exact for any cache dtype (fp32/fp16/bf16/fp8) and never touches NaN payloads.
Connectors use pack/unpack around a transfer (one staging row per block); the engine uses
copy_blocks for copy-on-write of shared blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK_BYTES = 16384


@triton.jit
def _copy_rows_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    row_numel,
    CHUNK: tl.constexpr,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    src_row = tl.load(src_ids_ptr + i) if SRC_INDEXED else i
    dst_row = tl.load(dst_ids_ptr + i) if DST_INDEXED else i
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < row_numel
    x = tl.load(src_ptr + src_row * row_numel + offs, mask=mask)
    tl.store(dst_ptr + dst_row * row_numel + offs, x, mask=mask)


def _as_int(t: torch.Tensor) -> torch.Tensor:
    assert t.element_size() in _INT_OF_SIZE, f"unsupported element size {t.element_size()}"
    return t.view(_INT_OF_SIZE[t.element_size()])


def _check_cache(kv_cache: torch.Tensor) -> int:
    assert kv_cache.dim() == 6, (
        f"kv_cache must be [num_blocks, num_layers, 2, block_size, Hkv, D], got {kv_cache.shape}"
    )
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous: a block is one flat run"
    return kv_cache[0].numel()


def _check_ids(ids: torch.Tensor, kv_cache: torch.Tensor, what: str) -> None:
    assert ids.dim() == 1 and ids.dtype == torch.int64, f"{what} must be a 1-D int64 tensor"
    assert ids.is_contiguous() and ids.device == kv_cache.device, (
        f"{what}: contiguous, cache's device"
    )


def _launch(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor | None,
    dst_ids: torch.Tensor | None,
    num_rows: int,
    row_numel: int,
) -> None:
    if num_rows == 0:
        return
    chunk = _CHUNK_BYTES // src.element_size()
    grid = (num_rows, triton.cdiv(row_numel, chunk))
    src_ints, dst_ints = _as_int(src), _as_int(dst)
    _copy_rows_kernel[grid](
        src_ints,
        dst_ints,
        src_ids if src_ids is not None else src_ints,  # unused when not indexed
        dst_ids if dst_ids is not None else dst_ints,
        row_numel,
        CHUNK=chunk,
        SRC_INDEXED=src_ids is not None,
        DST_INDEXED=dst_ids is not None,
        num_warps=8,
    )


def pack_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """staging[i] = kv_cache[block_ids[i]].flatten(); returns staging [n, block_numel].

    `out` may be a preallocated staging buffer (e.g. one registered with a transfer agent).
    """
    block_numel = _check_cache(kv_cache)
    _check_ids(block_ids, kv_cache, "block_ids")
    num_blocks = block_ids.numel()
    if out is None:
        out = torch.empty((num_blocks, block_numel), dtype=kv_cache.dtype, device=kv_cache.device)
    assert out.shape == (num_blocks, block_numel), (
        f"staging {out.shape} != {(num_blocks, block_numel)}"
    )
    assert out.is_contiguous() and out.dtype == kv_cache.dtype and out.device == kv_cache.device
    _launch(kv_cache, out, block_ids, None, num_blocks, block_numel)
    return out


def unpack_blocks(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """kv_cache[block_ids[i]] = staging[i] for every row i of staging [n, block_numel]."""
    block_numel = _check_cache(kv_cache)
    _check_ids(block_ids, kv_cache, "block_ids")
    num_blocks = block_ids.numel()
    assert staging.shape == (num_blocks, block_numel), (
        f"staging {staging.shape} != {(num_blocks, block_numel)}"
    )
    assert staging.is_contiguous() and staging.dtype == kv_cache.dtype
    assert staging.device == kv_cache.device
    _launch(staging, kv_cache, None, block_ids, num_blocks, block_numel)


def copy_blocks(
    kv_cache: torch.Tensor, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor
) -> None:
    """kv_cache[dst_block_ids[i]] = kv_cache[src_block_ids[i]], all in parallel.

    No destination may also be a source (copies run concurrently, unlike the sequential reference).
    """
    block_numel = _check_cache(kv_cache)
    _check_ids(src_block_ids, kv_cache, "src_block_ids")
    _check_ids(dst_block_ids, kv_cache, "dst_block_ids")
    assert src_block_ids.shape == dst_block_ids.shape, "src and dst block id lists differ in length"
    _launch(kv_cache, kv_cache, src_block_ids, dst_block_ids, src_block_ids.numel(), block_numel)
