"""The references themselves, against independent PyTorch ops; and the package's lazy import."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from splitserve.kernels.reference import ref_paged_decode_attention, ref_paged_prefill_attention


def _contiguous_prompt_in_cache(gen: torch.Generator, seq_len: int, block_size: int = 16):
    """One sequence's K/V [L, Hkv, D] written into a shuffled paged cache, plus its block table."""
    hkv, d = 2, 32
    k = torch.randn(seq_len, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(seq_len, hkv, d, generator=gen, dtype=torch.float64)
    num_blocks = -(-seq_len // block_size)
    table = torch.randperm(num_blocks + 2, generator=gen)[:num_blocks]
    cache = torch.randn(
        num_blocks + 2, 2, 2, block_size, hkv, d, generator=gen, dtype=torch.float64
    )
    for i in range(seq_len):
        cache[table[i // block_size], 1, 0, i % block_size] = k[i]
        cache[table[i // block_size], 1, 1, i % block_size] = v[i]
    return k, v, cache[:, 1, 0], cache[:, 1, 1], table[None].to(torch.int32)


def test_ref_prefill_is_causal_sdpa(gen):
    seq_len, hq = 45, 8
    k, v, k_cache, v_cache, table = _contiguous_prompt_in_cache(gen, seq_len)
    q = torch.randn(seq_len, hq, k.shape[-1], generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, seq_len], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    got = ref_paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, 0.3)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        scale=0.3,
        enable_gqa=True,
    ).transpose(0, 1)
    torch.testing.assert_close(got, want)

    # A chunk of the last 13 tokens over the cached prefix equals the same rows of the full prompt.
    cu = torch.tensor([0, 13], dtype=torch.int32)
    chunk = ref_paged_prefill_attention(q[-13:], k_cache, v_cache, table, cu, lens, 0.3)
    torch.testing.assert_close(chunk, want[-13:])
    # And decode of the last token equals its last row.
    last = ref_paged_decode_attention(q[-1:], k_cache, v_cache, table, lens, 0.3)
    torch.testing.assert_close(last, want[-1:])


def test_import_does_not_need_triton():
    code = (
        "import sys\n"
        "import splitserve.kernels as k, splitserve.kernels.reference\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
        "sys.modules['triton'] = None  # as if it were not installed\n"
        "assert not k.triton_available()\n"
        "try:\n"
        "    k.paged_decode_attention\n"
        "except ImportError as e:\n"
        "    assert 'needs triton' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no ImportError without triton')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names_stay_functions():
    """Importing the module reshape_and_cache first must not shadow the function of that name."""
    code = (
        "from splitserve.kernels.reshape_and_cache import reshape_and_cache as direct\n"
        "import splitserve.kernels as k\n"
        "from splitserve.kernels import reshape_and_cache, pack_blocks\n"
        "assert reshape_and_cache is direct and k.reshape_and_cache is direct, reshape_and_cache\n"
        "assert callable(pack_blocks) and k.triton_available()\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
