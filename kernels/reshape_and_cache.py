"""Write this step's keys and values into the paged KV cache, one program per token.

    key, value : [num_tokens, num_kv_heads, head_dim]      (rows of the QKV projection; any token stride)
    k_cache    : [num_blocks, block_size, num_kv_heads, head_dim] = kv_cache[:, layer, 0]  (strided view)
    slot       : slot_mapping[t] = block_id * block_size + offset, or -1 for "do not write" (padding)

Program t reads token t's whole [num_kv_heads, head_dim] tile (one contiguous run of the cache row)
and stores it at k_cache[slot // block_size, slot % block_size]; the same for V. Block ids are widened
to int64 before they meet stride(0), which spans every layer of a block and overflows int32 on big
caches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import check_paged_cache, pow2_at_least


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_b,
    stride_cache_t,
    stride_cache_h,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    src_k = key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :]
    src_v = value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :]
    dst = block_id * stride_cache_b + offset * stride_cache_t
    dst += offs_h[:, None] * stride_cache_h + offs_d[None, :]

    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache[slot // bs, slot % bs] = key[t] (and V alike) for every t with slot_mapping[t] >= 0.

    key, value: [T, Hkv, D]; k_cache, v_cache: [num_blocks, bs, Hkv, D] per-layer views;
    slot_mapping: [T] int64. Two tokens must not share a slot.
    """
    block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache)
    num_tokens = key.shape[0]
    assert key.shape == (num_tokens, num_kv_heads, head_dim), (
        f"key {key.shape} vs cache {k_cache.shape}"
    )
    assert value.shape == key.shape, f"value {value.shape} != key {key.shape}"
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim of key/value must be contiguous"
    assert key.dtype == value.dtype == k_cache.dtype, (
        f"key/value/cache dtypes differ: {key.dtype}, {value.dtype}, {k_cache.dtype}"
    )
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert slot_mapping.stride(0) == 1 or num_tokens <= 1
    assert key.device == value.device == k_cache.device == slot_mapping.device
    if num_tokens == 0:
        return

    num_elems = num_kv_heads * head_dim
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=pow2_at_least(num_kv_heads),
        HEAD_DIM_PAD=pow2_at_least(head_dim),
        num_warps=4 if num_elems >= 1024 else 2 if num_elems >= 256 else 1,
    )
