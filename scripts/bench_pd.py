"""Colocated vs 1P1D on one mixed workload, plus the router's added latency.

`python scripts/bench_pd.py [--model DIR] [--out bench_pd.json]`

Workload: `--decoders` streams with short prompts and long outputs start first; while they
decode, `--long` long-prompt requests arrive every `--gap` seconds. Colocated: one instance on
all cores behind the router. 1P1D: prefill pinned to core 0, decode to core 1 (sched_setaffinity
on the whole process group). Reported: TTFT and TPOT p50/p99, goodput (requests/s meeting both
SLOs), and the router's p50 overhead (same 1-token request through the router vs direct).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import Fleet, resolve_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    start, first, times = time.perf_counter(), None, []
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:  # a rejected request must not count as a fast one
            raise RuntimeError(f"request failed ({r.status_code}): {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                first = first or now
                times.append(now)
    end = time.perf_counter()
    n = max(1, len(times) - 1)
    return {"ttft": (first or end) - start, "tpot": (end - (first or end)) / n,
            "latency": end - start}


def long_prompt(args: argparse.Namespace) -> str:
    """The long prompts' text (each gets a distinct first word: no prefix-cache hits)."""
    return "The quick brown fox jumps over the lazy dog. " * args.long_repeat


async def workload(url: str, args: argparse.Namespace) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(one(client, url, f"story {i}:", args.decode_tokens))
                 for i in range(args.decoders)]
        await asyncio.sleep(1.0)
        for i in range(args.long):
            tasks.append(asyncio.create_task(one(client, url, f"{i} {long_prompt(args)}", 16)))
            await asyncio.sleep(args.gap)
        return await asyncio.gather(*tasks)


async def overhead(router: str, instance: str, n: int) -> dict:
    async with httpx.AsyncClient(timeout=60) as client:
        async def lat(url: str) -> float:
            t = time.perf_counter()
            r = await client.post(f"{url}/v1/completions",
                                  json={"prompt": "hi", "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            return time.perf_counter() - t
        for _ in range(5):
            await lat(router), await lat(instance)
        via, direct = [], []
        for _ in range(n):  # interleaved: a load spike on a shared machine hits both alike
            via.append(await lat(router))
            direct.append(await lat(instance))
    return {"router_p50_ms": statistics.median(via) * 1e3,
            "direct_p50_ms": statistics.median(direct) * 1e3,
            "overhead_p50_ms": (statistics.median(via) - statistics.median(direct)) * 1e3,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


def pin(fleet: Fleet, name: str, cpus: set[int]) -> None:
    pgid = fleet.child(name).proc.pid
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.getpgid(int(pid)) == pgid:
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        os.sched_setaffinity(int(tid), cpus)
            except (OSError, ProcessLookupError):
                pass


def plot(rows: dict[str, dict], slo: dict[str, float], path: str) -> None:
    """TTFT and TPOT CDFs of every request, one line per topology, the SLOs dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("ttft", "tpot"), strict=True):
        for name, row in rows.items():
            xs = sorted(r[key] for r in row["requests_raw"])
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
        ax.axvline(slo[key], color="grey", linestyle="--", label=f"SLO {slo[key]:.3g} s")
        ax.set_xscale("log")
        ax.set_xlabel(f"{key.upper()} (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("colocated vs disaggregated: per-request latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results]
    return {"ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "tpot_p50": pct(tpot, 0.5),
            "tpot_p99": pct(tpot, 0.99), "requests": len(results), "wall_s": wall,
            "requests_raw": results}


def goodput(row: dict, slo: dict[str, float]) -> tuple[int, float]:
    """Requests meeting both SLOs, and those per second of the run."""
    good = sum(r["ttft"] <= slo["ttft"] and r["tpot"] <= slo["tpot"] for r in row["requests_raw"])
    return good, good / row["wall_s"]


async def unloaded(url: str, args: argparse.Namespace) -> dict[str, float]:
    """Latency without interference, the yardstick of `--slo-scale`: the decoder streams alone
    (TPOT p50) and one long prompt alone (TTFT)."""
    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, url, "warm-up", 8)
        streams = await asyncio.gather(*(one(client, url, f"alone {i}:", args.decode_tokens)
                                         for i in range(args.decoders)))
        alone = await one(client, url, f"alone {long_prompt(args)}", 16)
    return {"tpot": statistics.median(r["tpot"] for r in streams), "ttft": alone["ttft"]}


def run(config: str, args: argparse.Namespace, port: int) -> dict:
    overrides = {"router": {"port": port}, "prefill": {"base_port": port + 10},
                 "decode": {"base_port": port + 20}, "colocated": {"base_port": port + 30}}
    if config == "colocated":
        overrides["engine"] = {"num_threads": max(1, len(os.sched_getaffinity(0)))}
    path, fleet_cfg = resolve_config(str(ROOT / "configs" / f"{config}.yaml"), args.model, None,
                                     overrides)
    with Fleet(path, fleet_cfg, quiet=True) as fleet:
        fleet.start()
        if config != "colocated":
            cpus = sorted(os.sched_getaffinity(0))
            pin(fleet, "prefill-0", {cpus[0]})
            pin(fleet, "decode-0", {cpus[-1]})
        base = asyncio.run(unloaded(fleet.url, args)) if config == "colocated" else None
        t = time.perf_counter()
        results = asyncio.run(workload(fleet.url, args))
        out = summarize(results, time.perf_counter() - t)
        if base is not None:
            out["unloaded"] = base
        instance = fleet_cfg.instances()[-1][2]
        out.update(asyncio.run(overhead(fleet.url, instance, args.overhead_n)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    p.add_argument("--pd-config", default="1p1d-nixl")
    p.add_argument("--decoders", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--long", type=int, default=8)
    p.add_argument("--long-repeat", type=int, default=150,
                   help="long prompt ≈ 20×this tokens (tiny model's tokenizer)")
    p.add_argument("--gap", type=float, default=0.5)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    p.add_argument("--slo-scale", type=float, help="SLOs = this × the unloaded colocated TTFT "
                   "of one long prompt and TPOT of the decoders (overrides --slo-ttft/-tpot)")
    p.add_argument("--overhead-n", type=int, default=50)
    p.add_argument("--out", default="bench_pd.json")
    p.add_argument("--plot", default="bench_pd.png", help="PNG of TTFT/TPOT CDFs ('' = none)")
    args = p.parse_args()
    rows = {"colocated": run("colocated", args, 31000), args.pd_config: run(args.pd_config, args,
                                                                            31100)}
    base = rows["colocated"]["unloaded"]
    slo = {"ttft": args.slo_ttft, "tpot": args.slo_tpot}
    if args.slo_scale:
        slo = {k: args.slo_scale * v for k, v in base.items()}
    for row in rows.values():
        row["good_requests"], row["goodput_rps"] = goodput(row, slo)
    keys = ["ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "goodput_rps", "overhead_p50_ms"]
    print(f"unloaded (colocated): TTFT {base['ttft']:.3f} s, TPOT {base['tpot']:.4f} s; "
          f"SLO: TTFT <= {slo['ttft']:.3f} s, TPOT <= {slo['tpot']:.4f} s")
    print(f"{'metric':<18}" + "".join(f"{name:>14}" for name in rows))
    for k in keys:
        print(f"{k:<18}" + "".join(f"{rows[n][k]:>14.4f}" for n in rows))
    print("goodput (req/s) by SLO scale × unloaded:")
    for scale in (1.5, 2, 3, 5, 10):
        scaled = {k: scale * v for k, v in base.items()}
        print(f"  {scale:>4}x" + "".join(f"{goodput(rows[n], scaled)[1]:>14.2f}" for n in rows))
    Path(args.out).write_text(json.dumps({"args": vars(args), "slo": slo, "results": rows},
                                         indent=2))
    print(f"wrote {args.out}")
    if args.plot:
        plot(rows, slo, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
