"""C++ kernels of the CPU path (csrc/), compiled on first use and cached.

    paged_decode_attention   one query token per sequence, straight from the paged KV cache

The CPU engine runs without them (the PyTorch backend gathers blocks instead), so a machine with
no C++ compiler still serves; `available()` says whether they built. They are compiled with
`-march=native` for the machine at hand, so the build directory is keyed by the source, the
torch version and the CPU's flags: a cache shared between different machines never hands one
the other's binary. `SPLITSERVE_CPU_KERNELS=0` turns them off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_attention.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-DNDEBUG"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build_dir() -> Path:
    key = hashlib.blake2b(digest_size=8)
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), _cpu_flags().encode(),
                 " ".join(_CFLAGS).encode()):
        key.update(part)
    root = Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))
    path = root / "cpu_kernels" / key.hexdigest()
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the CPU kernels; False, with a warning, if that fails."""
    if os.environ.get("SPLITSERVE_CPU_KERNELS", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        load(name="splitserve_cpu", sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
             extra_ldflags=["-fopenmp"],
             build_directory=str(_build_dir()), is_python_module=False, verbose=False)
    except Exception as err:  # no compiler, no ninja, a read-only home: fall back to PyTorch
        logger.warning("CPU attention kernels unavailable (%s: %s); using the PyTorch path",
                       type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return False
    return True


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q [S, Hq, D] (one token per sequence) over its paged K/V → [S, Hq, D]; fp32 accumulation.

    k_cache/v_cache: kv_cache[:, layer, 0|1] views [num_blocks, block_size, Hkv, D];
    block_tables [S, max_blocks] int32/int64; seq_lens [S] int32 counts the query token (already
    written to the cache); a row with seq_lens 0 is padding and gets zeros. Same contract as the
    Triton kernel and `reference.ref_paged_decode_attention`.
    """
    if not available():
        raise RuntimeError("the CPU kernels did not build; see the warning logged above")
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    torch.ops.splitserve_cpu.paged_decode_attention(out, q, k_cache, v_cache, block_tables,
                                                    seq_lens, scale)
    return out
