"""A linear layer whose GEMM may run wider than the model's dtype.

On a CPU without native 16-bit matrix instructions (AVX2: no AVX512-BF16, no AMX), PyTorch's bf16
and fp16 GEMMs take a slow path: measured on such a machine, 64 x 256 x 768 took 2.2 ms in bf16
and 0.26 ms in fp32. A bf16 GEMM means bf16 inputs, fp32 accumulation and a bf16 result, so
running it as an fp32 GEMM on the same (bf16-valued) weights and inputs and rounding the result
to bf16 computes the same thing, only faster there. The loader decides (`upcast_gemms`); the
weights keep their bf16 values (rounded first, then widened) and the activations stay bf16.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.compute_dtype: torch.dtype | None = None  # set by widen_gemm(); None: weight's dtype

    def widen_gemm(self, compute_dtype: torch.dtype) -> None:
        """Store the (already rounded) weights in `compute_dtype` and run the GEMM in it."""
        self.weight = nn.Parameter(self.weight.detach().to(compute_dtype), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().to(compute_dtype), requires_grad=False)
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is None:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x.to(self.compute_dtype), self.weight, self.bias).to(x.dtype)


@functools.cache
def cpu_has_native_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU runs `dtype` GEMMs natively (oneDNN's own capability check)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def upcast_gemms(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Run every Linear's GEMM in fp32 where 16-bit GEMMs are slow here; True if it did."""
    if device.type != "cpu" or cpu_has_native_gemm(dtype):
        return False
    for module in model.modules():
        if isinstance(module, Linear):
            module.widen_gemm(torch.float32)
    return True
