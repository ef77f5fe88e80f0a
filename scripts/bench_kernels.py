"""Benchmark the Triton attention kernels on a CUDA GPU.

    python scripts/bench_kernels.py --out results.json

- Paged decode attention: achieved bandwidth (bytes of K/V read / time) next to a device-to-device
  copy measured in the same run (bytes read + written / time), i.e. how close decode gets to the
  memory system's practical peak. Default: batch 64 x 4k context, bf16, head_dim 128, 8 KV heads,
  32 query heads, block size 16; plus a long-context, small-batch row where split-K matters.
- Paged prefill attention: TFLOP/s next to torch's scaled_dot_product_attention on the same causal
  shapes (4 x 2048 tokens by default), K/V contiguous and pre-expanded to all query heads for SDPA.

Times are medians over repeated runs, each timed with its own pair of CUDA events. Every row also
reports the largest difference from a reference (SDPA, or kernels/reference.py on a few sequences),
so a fast wrong kernel cannot go unnoticed. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    context: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass(frozen=True)
class PrefillCase:
    batch: int
    seq_len: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


DECODE_CASES = [DecodeCase(64, 4096), DecodeCase(1, 32768), DecodeCase(16, 8192)]
PREFILL_CASES = [PrefillCase(4, 2048), PrefillCase(1, 8192)]


def time_ms(fn: Callable[[], Any], warmup: int, reps: int) -> float:
    """Median milliseconds of fn() over reps runs, each between its own CUDA events."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def paged_cache(
    num_seqs: int,
    context: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random 2-layer block-major cache and shuffled block tables: (kv_cache, block_tables)."""
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, 2, 2, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, dtype=dtype, device="cuda")
    block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int64)
    block_tables = block_tables.view(num_seqs, blocks_per_seq).to(torch.int32)
    return kv_cache, block_tables


def bench_copy(num_bytes: int, warmup: int, reps: int) -> dict[str, float]:
    """Device-to-device copy of num_bytes: the practical bandwidth ceiling of this GPU."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, reps)
    return {"bytes": num_bytes, "ms": ms, "gb_per_s": 2 * num_bytes / ms / 1e6}


def bench_decode(case: DecodeCase, copy_gbps: float, warmup: int, reps: int) -> dict[str, Any]:
    from splitserve.kernels import paged_decode_attention
    from splitserve.kernels.decode_attention import _launch_config, choose_num_splits
    from splitserve.kernels.reference import ref_paged_decode_attention

    dtype = torch.bfloat16
    kv_cache, block_tables = paged_cache(
        case.batch, case.context, case.block_size, case.num_kv_heads, case.head_dim, dtype
    )
    k_cache, v_cache = kv_cache[:, 0, 0], kv_cache[:, 0, 1]
    q = torch.randn(case.batch, case.num_q_heads, case.head_dim, dtype=dtype, device="cuda")
    seq_lens = torch.full((case.batch,), case.context, dtype=torch.int32, device="cuda")
    scale = case.head_dim**-0.5
    out = torch.empty_like(q)

    def run() -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out)

    ms = time_ms(run, warmup, reps)
    n = min(case.batch, 4)
    want = ref_paged_decode_attention(
        q[:n], k_cache, v_cache, block_tables[:n], seq_lens[:n], scale
    )
    kv_bytes = 2 * case.batch * case.context * case.num_kv_heads * case.head_dim * dtype.itemsize
    splits = choose_num_splits(
        case.batch,
        case.num_kv_heads,
        block_tables.shape[1] * case.block_size,
        _launch_config(case.head_dim, dtype)[0],
        q.device,
    )
    gbps = kv_bytes / ms / 1e6
    return {
        **asdict(case),
        "dtype": "bf16",
        "num_splits": splits,
        "ms": ms,
        "kv_bytes": kv_bytes,
        "gb_per_s": gbps,
        "fraction_of_copy": gbps / copy_gbps,
        "max_abs_diff": (run()[:n].float() - want.float()).abs().max().item(),
    }


def bench_prefill(case: PrefillCase, warmup: int, reps: int) -> dict[str, Any]:
    from splitserve.kernels import paged_prefill_attention

    dtype = torch.bfloat16
    b, length, hq, hkv, d = (
        case.batch,
        case.seq_len,
        case.num_q_heads,
        case.num_kv_heads,
        case.head_dim,
    )
    kv_cache, block_tables = paged_cache(b, length, case.block_size, hkv, d, dtype)
    k_cache, v_cache = kv_cache[:, 0, 0], kv_cache[:, 0, 1]
    q = torch.randn(b * length, hq, d, dtype=dtype, device="cuda")
    cu = torch.arange(0, (b + 1) * length, length, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    scale = d**-0.5
    out = torch.empty_like(q)

    def run_paged() -> torch.Tensor:
        return paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu, seq_lens, scale, out=out
        )

    # The same K/V, gathered contiguous for SDPA: [B, Hq, L, D] (GQA pre-expanded, not timed).
    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        per_seq = cache[block_tables.long()].reshape(b, -1, hkv, d)[:, :length]
        return per_seq.transpose(1, 2).repeat_interleave(hq // hkv, dim=1).contiguous()

    k, v = contiguous(k_cache), contiguous(v_cache)
    q_sdpa = q.view(b, length, hq, d).transpose(1, 2).contiguous()

    def run_sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_sdpa, k, v, is_causal=True, scale=scale)

    ms_paged = time_ms(run_paged, warmup, reps)
    ms_sdpa = time_ms(run_sdpa, warmup, reps)
    flops = 4 * b * hq * d * length * (length + 1) / 2  # QK^T and PV over the causal half
    got = run_paged().view(b, length, hq, d).transpose(1, 2).float()
    return {
        **asdict(case),
        "dtype": "bf16",
        "flops": flops,
        "ms_paged": ms_paged,
        "ms_sdpa": ms_sdpa,
        "tflops_paged": flops / ms_paged / 1e9,
        "tflops_sdpa": flops / ms_sdpa / 1e9,
        "max_abs_diff": (got - run_sdpa().float()).abs().max().item(),
    }


def print_tables(results: dict[str, Any]) -> None:
    copy = results["copy"]
    print(f"device: {results['device']}   d2d copy: {copy['gb_per_s']:.0f} GB/s (read + write)")
    print()
    print("paged decode (bf16)      splits      ms    GB/s   of copy   max|diff|")
    for r in results["decode"]:
        name = f"{r['batch']} x {r['context']} q{r['num_q_heads']}/kv{r['num_kv_heads']}"
        print(
            f"{name:<24} {r['num_splits']:>6} {r['ms']:>7.3f} {r['gb_per_s']:>7.0f}"
            f" {r['fraction_of_copy']:>8.0%} {r['max_abs_diff']:>11.2e}"
        )
    print()
    print("paged prefill (bf16)     ms paged  ms sdpa  TFLOP/s paged  TFLOP/s sdpa   max|diff|")
    for r in results["prefill"]:
        name = f"{r['batch']} x {r['seq_len']} causal"
        print(
            f"{name:<24} {r['ms_paged']:>8.3f} {r['ms_sdpa']:>8.3f} {r['tflops_paged']:>14.1f}"
            f" {r['tflops_sdpa']:>13.1f} {r['max_abs_diff']:>11.2e}"
        )


def bench_engine(model_dir: str, batch: int = 64, input_len: int = 128,
                 output_len: int = 256) -> dict[str, Any]:
    """The whole engine on CUDA (Triton backend): decode throughput of `batch` requests."""
    from splitserve import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", device="cuda", kv_cache_memory="8GiB",
              max_model_len=input_len + output_len + 1)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 3 for j in range(input_len)]}
               for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"model": model_dir, "batch": batch, "input_len": input_len,
            "output_len": output_len, "seconds": elapsed,
            "output_tokens_per_s": batch * output_len / elapsed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results.json", help="where to write the JSON results")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--engine-model", default=None,
                        help="model dir for the engine decode benchmark (e.g. the small preset "
                             "from make_tiny_model.py --preset small); skipped when unset")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "bench_kernels.py needs a CUDA GPU: the kernels are benchmarked natively "
            "(for the CPU interpreter checks run `python -m pytest tests/kernels`)",
            file=sys.stderr,
        )
        return 2

    torch.manual_seed(0)
    import triton

    largest = max(DECODE_CASES, key=lambda c: c.batch * c.context)
    kv_bytes = 2 * largest.batch * largest.context * largest.num_kv_heads * largest.head_dim * 2
    copy = bench_copy(kv_bytes, args.warmup, args.reps)
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy": copy,
        "decode": [bench_decode(c, copy["gb_per_s"], args.warmup, args.reps) for c in DECODE_CASES],
        "prefill": [bench_prefill(c, args.warmup, args.reps) for c in PREFILL_CASES],
    }
    if args.engine_model:
        results["engine"] = bench_engine(args.engine_model)
        print(f"engine decode: {results['engine']['output_tokens_per_s']:.0f} output tok/s")
    print_tables(results)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
