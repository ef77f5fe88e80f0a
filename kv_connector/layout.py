"""Block arithmetic and byte views shared by the connectors.

Token positions and blocks, for block_size 4 and a request whose first 8 tokens were a local
prefix-cache hit and whose next 6 come from outside:

```
position     0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15
block index  0       | 1       | 2         | 3
             local hit (num_computed=8)      | loaded (num_external=6): blocks 2..3
```

The loaded range [8, 14) covers block indexes 2 and 3 of the request; both the producer's block
list and the consumer's are indexed the same way, so block index i of one lands in block index i
of the other. A partial last block is copied whole; the consumer overwrites the slots past the
loaded range when it computes them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_range(start_token: int, num_tokens: int, block_size: int) -> range:
    """Block indexes covering token positions [start_token, start_token + num_tokens)."""
    if num_tokens <= 0:
        return range(0)
    return range(start_token // block_size, cdiv(start_token + num_tokens, block_size))


def contiguous_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Split a block mapping src[i] → dst[i] into (src_start, dst_start, length) runs in which
    both sides are consecutive, so each run moves as one contiguous region."""
    if len(src) != len(dst):
        raise ValueError(f"block lists differ in length: {len(src)} vs {len(dst)}")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def block_bytes(kv_cache: torch.Tensor, num_blocks: int, block_nbytes: int) -> torch.Tensor:
    """The KV tensor as bytes: [num_blocks, block_nbytes] uint8, sharing its memory."""
    import torch

    if not kv_cache.is_contiguous():
        raise ValueError("the KV cache tensor must be contiguous (block-major)")
    if kv_cache.shape[0] != num_blocks:
        raise ValueError(f"KV cache has {kv_cache.shape[0]} blocks, EngineInfo says {num_blocks}")
    view = kv_cache.view(torch.uint8).view(num_blocks, -1)  # [num_blocks, block_nbytes]
    if view.shape[1] != block_nbytes:
        raise ValueError(f"a KV block is {view.shape[1]} bytes, EngineInfo says {block_nbytes}")
    return view


def block_checksums(blocks: torch.Tensor, block_ids: list[int]) -> list[int]:
    """xxhash64 of each listed block of a [num_blocks, block_nbytes] uint8 view."""
    out = []
    for b in block_ids:
        row = blocks[b]
        if row.device.type != "cpu":
            row = row.cpu()
        out.append(xxhash.xxh64_intdigest(row.numpy()))
    return out


def first_mismatch(expected: list[int], actual: list[int]) -> int | None:
    """Index of the first differing checksum, or None when they all agree."""
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        if e != a:
            return i
    return None


def bounded_put(d: dict, key: object, value: object, limit: int = 8192) -> None:
    """d[key] = value, dropping the oldest entries past `limit` (scheduler-side per-request
    state of requests the engine aborted without telling the connector)."""
    d.pop(key, None)
    d[key] = value
    while len(d) > limit:
        del d[next(iter(d))]


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def set_loopback_env(host: str, names: tuple[str, ...]) -> None:
    """Point a transport at the loopback device for single-host runs, unless the user chose."""
    if is_loopback(host):
        for name in names:
            os.environ.setdefault(name, "lo")
