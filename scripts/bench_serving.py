"""Benchmark any OpenAI-compatible completions endpoint (ours, the router, vLLM) over streaming.

Prompts are token-id lists (`"prompt": [ids]`) and requests set `ignore_eos`, so input and output
lengths are exact on every server. Per request it records TTFT (first chunk with a choice), each
inter-token latency (gap between chunks), TPOT ((E2E - TTFT) / (output tokens - 1)) and E2E.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --dataset fixed \\
        --input-len 128 --output-len 128 --num-prompts 256 --max-concurrency 64 \\
        --slo ttft_ms=500,tpot_ms=50 --out results.json --plot cdf.png

Arrivals are a Poisson process of `--request-rate` requests/s (`inf`: all at once), optionally
capped at `--max-concurrency` requests in flight. Datasets: `fixed` (every prompt input-len
tokens), `random` (lengths drawn from [len*(1-r), len*(1+r)] with --range-ratio r, seeded),
`shared-prefix` (`--num-prefixes` groups share a `--prefix-len` prefix, then input-len own tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
from tqdm.auto import tqdm


@dataclass
class BenchRequest:
    prompt: list[int]
    output_len: int


@dataclass
class RequestResult:
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    ok: bool = False
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


# ------------------------------------------------------------------------------------ datasets
def make_dataset(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    lo, hi = 10, max(11, vocab_size - 10)  # keep clear of special tokens at the ends

    def tokens(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    def length(n: int) -> int:
        if args.dataset != "random":
            return n
        r = args.range_ratio
        return max(1, rng.randint(int(n * (1 - r)), int(n * (1 + r))))

    if args.dataset == "shared-prefix":
        prefixes = [tokens(args.prefix_len) for _ in range(args.num_prefixes)]
        return [
            BenchRequest(prefixes[i % args.num_prefixes] + tokens(args.input_len), args.output_len)
            for i in range(args.num_prompts)
        ]
    return [
        BenchRequest(tokens(length(args.input_len)), length(args.output_len))
        for _ in range(args.num_prompts)
    ]


# ------------------------------------------------------------------------------------ client
async def send_request(
    client: httpx.AsyncClient, url: str, model: str, req: BenchRequest
) -> RequestResult:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_len=len(req.prompt))
    start = time.perf_counter()
    reader = _SSEReader(result, start)
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            # Raw bytes, split by hand: httpx's line iterator costs more CPU than the server's
            # whole front end per token, and the client shares the machine with the server.
            async for raw in response.aiter_raw():
                if reader.feed(raw, time.perf_counter()):
                    break
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or reader.chunks
        result.ok = not result.error and reader.chunks > 0
    except (httpx.HTTPError, OSError) as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


class _SSEReader:
    """Timestamps SSE events as they arrive (events in one read share its arrival time)."""

    def __init__(self, result: RequestResult, start: float) -> None:
        self.result, self.start = result, start
        self.buffer = b""
        self.chunks, self.last = 0, 0.0

    def feed(self, raw: bytes, now: float) -> bool:
        """Consume bytes; True once `[DONE]` was seen."""
        *events, self.buffer = (self.buffer + raw).split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return True
                self._on_message(msgspec.json.decode(data), now)
        return False

    def _on_message(self, msg: dict[str, Any], now: float) -> None:
        r = self.result
        if msg.get("choices"):
            if self.chunks == 0:
                r.ttft = now - self.start
            else:
                r.itl.append(now - self.last)
            self.chunks, self.last = self.chunks + 1, now
        if msg.get("usage"):
            r.output_tokens = msg["usage"]["completion_tokens"]
        if "error" in msg:
            r.error = str(msg["error"])


async def arrivals(n: int, rate: float, rng: np.random.Generator):
    """Yield request indices on a Poisson schedule (all at once for rate = inf)."""
    for i in range(n):
        yield i
        if math.isfinite(rate) and rate > 0:
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))


async def run_benchmark(
    args: argparse.Namespace, url: str, model: str, requests: list[BenchRequest]
) -> tuple[list[RequestResult], float]:
    limit = args.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        for req in requests[: args.warmup]:  # warm the server's caches and code paths
            await send_request(client, url, model, BenchRequest(req.prompt, min(4, req.output_len)))
        semaphore = asyncio.Semaphore(limit)
        bar = tqdm(total=len(requests), desc="requests", disable=args.no_progress)

        async def one(req: BenchRequest) -> RequestResult:
            async with semaphore:
                result = await send_request(client, url, model, req)
            bar.update(1)
            return result

        tasks = []
        start = time.perf_counter()
        async for i in arrivals(len(requests), args.request_rate, np.random.default_rng(args.seed)):
            tasks.append(asyncio.create_task(one(requests[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration


# ------------------------------------------------------------------------------------ report
def parse_slo(text: str | None) -> dict[str, float]:
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("ttft_ms", "tpot_ms", "e2e_ms") or not value:
            raise SystemExit(f"bad --slo part {part!r} (use ttft_ms=..,tpot_ms=..,e2e_ms=..)")
        slo[key.strip()] = float(value)
    return slo


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    values = {"ttft_ms": r.ttft, "tpot_ms": r.tpot, "e2e_ms": r.e2e}
    return r.ok and all(values[k] * 1000 <= v for k, v in slo.items())


def summarize(
    results: list[RequestResult], duration: float, slo: dict[str, float]
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]

    def pct(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
        a = np.asarray(values) * 1000
        return {
            "mean": float(a.mean()),
            "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)),
        }

    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
        "total_output_tokens": out_tokens,
        "ttft_ms": pct([r.ttft for r in ok]),
        "tpot_ms": pct([r.tpot for r in ok if r.tpot]),
        "itl_ms": pct([x for r in ok for x in r.itl]),
        "e2e_ms": pct([r.e2e for r in ok]),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in results)
        summary.update(slo=slo, goodput=good / duration, slo_attainment=good / len(results))
    errors = [r.error for r in results if r.error][:3]
    if errors:
        summary["first_errors"] = errors
    return summary


def print_table(s: dict[str, Any]) -> None:
    print(f"{'completed / failed':<28}{s['completed']} / {s['failed']}")
    print(f"{'duration (s)':<28}{s['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':<28}{s['request_throughput']:.2f}")
    print(f"{'output throughput (tok/s)':<28}{s['output_throughput']:.1f}")
    print(f"{'total throughput (tok/s)':<28}{s['total_token_throughput']:.1f}")
    if "goodput" in s:
        print(
            f"{'goodput (req/s)':<28}{s['goodput']:.2f}  "
            f"({100 * s['slo_attainment']:.1f}% within {s['slo']})"
        )
    print(f"{'(ms)':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[key]
        print(
            f"{key[:-3].upper():<10}{v['mean']:>10.2f}{v['p50']:>10.2f}{v['p90']:>10.2f}"
            f"{v['p99']:>10.2f}"
        )
    for err in s.get("first_errors", []):
        print("error:", err)


def plot_cdfs(results: list[RequestResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    series = {
        "TTFT": [r.ttft for r in ok],
        "TPOT": [r.tpot for r in ok if r.tpot],
        "ITL": [x for r in ok for x in r.itl],
        "E2E": [r.e2e for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items(), strict=True):
        unit = "ms"
        if values:
            a = np.sort(np.asarray(values))
            unit, scale = ("s", 1.0) if a[-1] >= 10 else ("ms", 1000.0)  # readable ticks
            a = a * scale
            ax.plot(a, np.arange(1, len(a) + 1) / len(a))
            for q in (50, 90, 99):
                ax.axvline(np.percentile(a, q), ls=":", lw=0.8, color="gray")
        ax.set_title(f"{name} CDF (dotted: p50, p90, p99)")
        ax.set_xlabel(unit)
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of tokens")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------ main
def discover(base_url: str, model: str | None) -> tuple[str, int | None]:
    data = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    card = next((m for m in data if m["id"] == model), data[0]) if model else data[0]
    return card["id"], card.get("max_model_len")


def vocab_size_of(args: argparse.Namespace) -> int:
    if args.model_dir:
        return int(json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"])
    return args.vocab_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", help="served model name (default: the first of /v1/models)")
    p.add_argument("--model-dir", help="model directory, to read vocab_size for token ids")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--dataset", choices=["fixed", "random", "shared-prefix"], default="fixed")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5, help="random: length spread")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", help="e.g. ttft_ms=500,tpot_ms=50")
    p.add_argument("--label", default="", help="name of this run in the JSON and plot")
    p.add_argument("--out", help="write results JSON here")
    p.add_argument("--plot", help="write a PNG of latency CDFs here")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base = args.base_url.rstrip("/")
    slo = parse_slo(args.slo)
    model, _ = discover(base, args.model)
    requests = make_dataset(args, vocab_size_of(args))
    results, duration = asyncio.run(run_benchmark(args, base + args.endpoint, model, requests))
    summary = summarize(results, duration, slo)
    label = args.label or f"{model} @ {base}"
    print(
        f"== {label}: {args.dataset} {args.input_len} in / {args.output_len} out, "
        f"{args.num_prompts} prompts, rate {args.request_rate}, "
        f"concurrency {args.max_concurrency or 'unbounded'}"
    )
    print_table(summary)
    if args.out:
        config = {k: v for k, v in vars(args).items() if k not in ("out", "plot")}
        config["request_rate"] = str(args.request_rate)
        Path(args.out).write_text(
            json.dumps(
                {
                    "label": label,
                    "model": model,
                    "config": config,
                    "summary": summary,
                    "requests": [asdict(r) for r in results],
                },
                indent=1,
            )
        )
    if args.plot:
        plot_cdfs(
            results,
            args.plot,
            f"{label}: {args.dataset} {args.input_len}/"
            f"{args.output_len}, concurrency {args.max_concurrency or 'unbounded'}",
        )
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
