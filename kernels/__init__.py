"""Triton kernels of the CUDA path, one per module, and their PyTorch references.

    reshape_and_cache        write this step's K/V rows into the paged cache by slot
    paged_decode_attention   one query token per sequence, GQA-grouped, split-K for long contexts
    paged_prefill_attention  variable-length query chunks over cached prefix + causal chunk
    pack_blocks / unpack_blocks / copy_blocks   whole-block copies for KV transfer and copy-on-write

Importing this package never imports Triton: each name loads its module on first use, so CPU-only
installs (no triton) can import `splitserve.kernels` and ask `triton_available()`. The `ref_*` twins
live in `splitserve.kernels.reference` and need only PyTorch.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any

__all__ = [
    "copy_blocks",
    "pack_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "triton_available",
    "unpack_blocks",
]

# public name -> module (relative to this package) that defines it; imported on first access.
_LAZY = {
    "reshape_and_cache": ".reshape_and_cache",
    "paged_decode_attention": ".decode_attention",
    "paged_prefill_attention": ".prefill_attention",
    "pack_blocks": ".block_copy",
    "unpack_blocks": ".block_copy",
    "copy_blocks": ".block_copy",
}


@functools.cache
def triton_available() -> bool:
    """True when `import triton` works (it does not say that a GPU is present)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not triton_available():
        raise ImportError(
            f"splitserve.kernels.{name} needs triton, which is not installed "
            "(pip install 'splitserve[gpu]'; on CPU use splitserve.kernels.reference)"
        )
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _KernelsPackage(types.ModuleType):
    """Keeps the function `reshape_and_cache` from being shadowed by its module of the same name.

    Importing a submodule sets it as an attribute of its package, so a plain package would turn
    `splitserve.kernels.reshape_and_cache` into the module once anything imported
    `splitserve.kernels.reshape_and_cache` directly. Public names always stay functions; the modules
    remain reachable with `from splitserve.kernels.reshape_and_cache import ...` or importlib.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _KernelsPackage
