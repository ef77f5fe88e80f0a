"""The kernels compile for Hopper (sm_90) with the launch configs the wrappers pick, without a GPU.

The interpreter checks numerics but not what the GPU compiler makes of a kernel: it accepts code the
compiler rejects, and says nothing of shared memory, register spills or tensor-core use. Triton's
NVIDIA backend compiles to a cubin with the bundled ptxas and no CUDA driver, so CI checks here that
each 16-bit config fits an H200's shared memory, spills no registers, feeds the tensor cores (wgmma
for prefill, mma for the 16-row decode tiles) and pipelines its K/V loads with cp.async. fp32 runs
on FMA with IEEE precision and is only checked to compile and fit.

The compiles run in a subprocess (this file as a script) because the test process imported the
kernels under TRITON_INTERPRET=1, and such kernels cannot be compiled.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

SM90_MAX_SHARED = 232448  # bytes of shared memory one block may opt in to on H100/H200


def _compile_all() -> list[dict]:
    """Compile every checked config for sm_90; one result dict per kernel config."""
    import tempfile

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from splitserve.kernels import block_copy, decode_attention, prefill_attention

    # The package attribute `reshape_and_cache` is the function; the module is in sys.modules.
    reshape_and_cache = importlib.import_module("splitserve.kernels.reshape_and_cache")

    target = GPUTarget("cuda", 90, 32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    tl_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

    def compile_one(name, fn, ptr_types, constexprs, num_warps, num_stages=1, **meta):
        # As Triton's JIT specialises a real launch: pointers 16-byte aligned, strides multiples of 16.
        signature, attrs = {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                signature[arg] = "*" + ptr_types.get(arg, ptr_types["*"])
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[arg] = "fp32" if arg == "scale_log2" else "i32"
                if arg.startswith("stride") and arg != "stride_bt_s" or arg == "row_numel":
                    attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(
            src, target=target, options={"num_warps": num_warps, "num_stages": num_stages}
        )
        ptx = kernel.asm["ptx"]
        result = {
            "name": name,
            "shared": kernel.metadata.shared,
            "wgmma": "wgmma.mma_async" in ptx,
            "mma": "mma.sync" in ptx,
            "cp_async": "cp.async" in ptx,
            "stack": None,
            **meta,
        }
        if os.path.exists(cuobjdump):
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "k.cubin")
                with open(path, "wb") as f:
                    f.write(kernel.asm["cubin"])
                usage = subprocess.run(
                    [cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True
                ).stdout
            fields = dict(
                item.split(":", 1)
                for line in usage.splitlines()
                if "REG:" in line
                for item in line.split()
            )
            result["stack"] = int(fields["STACK"]) + int(fields["LOCAL"])
            result["regs"] = int(fields["REG"])
        return result

    results = []
    index_ptrs = {"block_tables_ptr": "i32", "seq_lens_ptr": "i32", "cu_query_lens_ptr": "i32"}
    for dtype, head_dim, split in [
        (torch.bfloat16, 128, False),
        (torch.bfloat16, 128, True),
        (torch.bfloat16, 64, False),
        (torch.float16, 128, True),
        (torch.float32, 128, True),
    ]:
        tile_n, num_warps = decode_attention._launch_config(head_dim, dtype)
        consts = {
            "BLOCK_SIZE": 16,
            "GROUP": 4,
            "GROUP_PAD": 16,
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": head_dim,
            "TILE_N": tile_n,
            "SPLIT": split,
            "DOT_FP32": False,
        }
        ptrs = {"*": tl_name[dtype], "part_out_ptr": "fp32", "part_lse_ptr": "fp32", **index_ptrs}
        results.append(
            compile_one(
                f"decode-{tl_name[dtype]}-d{head_dim}-split{split}",
                decode_attention._decode_kernel,
                ptrs,
                consts,
                num_warps,
                2,
                kind="decode",
                sixteen_bit=dtype != torch.float32,
            )
        )
    results.append(
        compile_one(
            "decode-reduce-bf16-d128",
            decode_attention._decode_reduce_kernel,
            {"*": "bf16", "part_out_ptr": "fp32", "part_lse_ptr": "fp32"},
            {"SPLITS_PAD": 64, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128},
            4,
            kind="elementwise",
        )
    )
    for dtype, head_dim in [
        (torch.bfloat16, 128),
        (torch.bfloat16, 64),
        (torch.float16, 128),
        (torch.float32, 64),
    ]:
        block_m, block_n, num_warps, num_stages = prefill_attention._launch_config(head_dim, dtype)
        consts = {
            "BLOCK_SIZE": 16,
            "GROUP": 4,
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": head_dim,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "DOT_FP32": False,
        }
        results.append(
            compile_one(
                f"prefill-{tl_name[dtype]}-d{head_dim}",
                prefill_attention._prefill_kernel,
                {"*": tl_name[dtype], **index_ptrs},
                consts,
                num_warps,
                num_stages,
                kind="prefill",
                sixteen_bit=dtype != torch.float32,
            )
        )
    results.append(
        compile_one(
            "reshape-and-cache-bf16",
            reshape_and_cache._reshape_and_cache_kernel,
            {"*": "bf16", "slot_mapping_ptr": "i64"},
            {
                "BLOCK_SIZE": 16,
                "NUM_KV_HEADS": 8,
                "HEAD_DIM": 128,
                "HEADS_PAD": 8,
                "HEAD_DIM_PAD": 128,
            },
            4,
            kind="elementwise",
        )
    )
    results.append(
        compile_one(
            "copy-rows-i16",
            block_copy._copy_rows_kernel,
            {"*": "i16", "src_ids_ptr": "i64", "dst_ids_ptr": "i64"},
            {"CHUNK": 8192, "SRC_INDEXED": True, "DST_INDEXED": True},
            8,
            kind="elementwise",
        )
    )
    return results


def test_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip(f"triton {triton.__version__} has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failures = []
    for r in results:
        if r["shared"] > SM90_MAX_SHARED:
            failures.append(f"{r['name']}: {r['shared']} B of shared memory")
        if r.get("sixteen_bit"):
            if r["stack"]:
                failures.append(f"{r['name']}: {r['stack']} B of register spills")
            if not r["cp_async"]:
                failures.append(f"{r['name']}: K/V loads are not pipelined (no cp.async)")
            if r["kind"] == "prefill" and not r["wgmma"]:
                failures.append(f"{r['name']}: no wgmma")
            if r["kind"] == "decode" and not (r["mma"] or r["wgmma"]):
                failures.append(f"{r['name']}: no tensor-core mma")
    assert not failures, "\n".join(failures) + "\n" + json.dumps(results, indent=1)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
