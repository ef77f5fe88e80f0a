"""Offline throughput: our `LLM.generate` vs HF `generate`, side by side in one run.

Same model directory, dtype and thread count for both. Workloads:
  fixed   N prompts x 128 input / 128 output tokens
  random  N prompts, input 16-1024 and output 16-512 tokens (seeded); EOS ignored
HF runs each workload as one left-padded batch that generates max(output) tokens; only the
requested tokens count toward its throughput (what a user of the batch gets).

    python scripts/bench_offline.py --model models/tiny-llama --dtype bfloat16 --out bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch


def workload(name: str, n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if name == "fixed":
        lens = [(128, 128)] * n
    elif name == "random":
        lens = [(rng.randint(16, 1024), rng.randint(16, 512)) for _ in range(n)]
    else:
        raise SystemExit(f"unknown workload {name!r} (known: fixed, random)")
    return [([rng.randrange(3, vocab) for _ in range(i)], o) for i, o in lens]


def run_ours(model: str, dtype: str, reqs, max_model_len: int) -> float:
    from splitserve import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, kv_cache_memory="4GiB",
              max_num_batched_tokens=2048)
    # Warm-up on the same prompts (2 tokens each), as for HF below: allocator and caches warm.
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs], SamplingParams(max_tokens=2),
                 use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(o for _, o in reqs)
    return elapsed


def run_hf(model: str, dtype: str, reqs) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    max_in = max(len(p) for p, _ in reqs)
    ids = torch.zeros((len(reqs), max_in), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(reqs):  # left padding
        ids[i, max_in - len(p):] = torch.tensor(p)
        mask[i, max_in - len(p):] = 1
    max_new = max(o for _, o in reqs)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        hf.generate(ids, attention_mask=mask, max_new_tokens=2, **kw)  # warm-up, same batch
        start = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, **kw)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--workloads", default="fixed,random")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="bench_offline.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rows = []
    for name in args.workloads.split(","):
        reqs = workload(name, args.num_prompts, vocab, args.seed)
        out_tokens = sum(o for _, o in reqs)
        max_len = max(len(p) + o for p, o in reqs) + 1
        ours = run_ours(args.model, args.dtype, reqs, max_len)
        hf = None if args.skip_hf else run_hf(args.model, args.dtype, reqs)
        row = {"workload": name, "num_prompts": len(reqs), "output_tokens": out_tokens,
               "ours_s": ours, "ours_tok_s": out_tokens / ours,
               "hf_s": hf, "hf_tok_s": out_tokens / hf if hf else None,
               "ratio": (hf / ours) if hf else None}
        rows.append(row)
        ratio = f"{row['ratio']:.2f}x" if hf else "-"
        hf_rate = f"{row['hf_tok_s']:.0f}" if hf else "-"
        print(f"{name:8s} ours {row['ours_tok_s']:8.0f} tok/s   HF {hf_rate:>8s} tok/s   {ratio}",
              flush=True)
    result = {"model": args.model, "dtype": args.dtype, "threads": args.threads,
              "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} (load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
