"""KV transfer throughput of each connector between two processes, against a plain copy.

For each connector, preset and dtype: a producer and a consumer `SimEngine` (see
kv_connector/driver.py, remote_engine.py) in two spawned processes move N blocks through the connector API, the way
the engine drives it; the consumer times each load from `start_load_kv` to `get_finished`
reporting it (redis: the producer's save is timed too). The same run measures a single-threaded
in-process `dst.copy_(src)` of the same bytes, the ceiling a transport is compared with; its
buffers sit on huge pages, as the connectors put the KV caches (kv_connector/hugepages.py), so
the baseline is the fastest plain copy, not a 4 KiB-page one.

    python scripts/bench_transfer.py                      # all connectors, tiny + small
    python scripts/bench_transfer.py --connectors nixl --presets small --blocks 512

Prints a table, writes JSON (and a PNG when matplotlib is installed) under bench_results/.
Redis: a private redis-server is started on a free port (and a unix socket) unless --redis-url
is given; `--redis-transport tcp,unix` measures the connector over both (rows `redis` and
`redis-unix`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

TARGETS = {"nixl": 0.5, "nccl": 0.3, "redis": 0.15}  # fraction of the single-thread copy


class Copier:
    """Single-threaded in-process `dst.copy_(src)` of the same bytes: the ceiling to compare with.

    Measured right after each transfer, so both see the same machine load."""

    def __init__(self, nbytes: int) -> None:
        import torch

        from splitserve.kv_connector.hugepages import empty_on_huge_pages

        cpu = torch.device("cpu")
        self.nbytes = nbytes
        self.src = empty_on_huge_pages(nbytes, cpu).view(torch.float32).uniform_(1, 2)
        self.dst = empty_on_huge_pages(nbytes, cpu).view(torch.float32)
        self.dst.copy_(self.src)

    def seconds(self, repeats: int = 3) -> float:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                self.dst.copy_(self.src)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        finally:
            torch.set_num_threads(threads)


class RedisProcess:
    """A private redis-server on a free TCP port and a unix socket (`urls` by transport)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self._dir = tempfile.TemporaryDirectory(prefix="bench-redis-")
        path = f"{self._dir.name}/redis.sock"
        self.urls = {"tcp": f"redis://127.0.0.1:{port}/0", "unix": f"unix://{path}"}
        self.url = self.urls["tcp"]
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--maxmemory",
                "0",
                "--unixsocket",
                path,
                "--unixsocketperm",
                "700",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def flush(self) -> None:
        import redis

        redis.Redis.from_url(self.url).flushall()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self._dir.cleanup()


def bench_one(
    connector: str,
    preset: str,
    dtype: str,
    mib: float,
    repeats: int,
    scattered: bool,
    options: dict[str, Any],
) -> list[dict[str, Any]]:
    """Median load (and redis save) time and GB/s of one configuration, with the copy ratio.
    `options`: the connector's, on top of a 60 s timeout."""
    from dataclasses import replace

    from splitserve.kv_connector.driver import PRESETS

    shape = replace(PRESETS[preset], dtype=dtype)
    num_blocks = max(1, int(mib * 2**20) // shape.block_nbytes)
    p, d = _engine_pair(connector, shape, num_blocks, scattered, options)
    try:
        times, copies = _measure(
            connector,
            p,
            d,
            num_blocks * shape.block_size,
            repeats,
            Copier(num_blocks * shape.block_nbytes),
        )
    finally:
        p.close()
        d.close()
    base = {
        "connector": connector,
        "preset": preset,
        "dtype": dtype,
        "layout": "scattered" if scattered else "contiguous",
        "blocks": num_blocks,
        "block_bytes": shape.block_nbytes,
        "bytes": num_blocks * shape.block_nbytes,
        "target": TARGETS.get(connector),
    }
    return [_row(base, op, ts, copies) for op, ts in times.items() if ts]


def _engine_pair(
    connector: str, shape: Any, num_blocks: int, scattered: bool, options: dict[str, Any]
) -> tuple[Any, Any]:
    """A producer and a consumer SimEngine, each in its own process, with room for the blocks."""
    from splitserve.kv_connector.remote_engine import RemoteEngine

    config = {"connector": connector, "options": {"timeout_s": 60, **options}, "lease_s": 300}
    engines = [
        RemoteEngine(
            {**config, "kv_role": role},
            shape,
            num_blocks + 4,
            f"{role}-bench",
            seed=seed,
            wait=False,
            shuffle_blocks=scattered,
            step_interval_s=0.001,
        )
        for role, seed in (("producer", 1), ("consumer", 2))
    ]
    p, d = (e.ready() for e in engines)
    return p, d


def _measure(
    connector: str, p: Any, d: Any, tokens: int, repeats: int, copier: Copier
) -> tuple[dict[str, list[float]], list[float]]:
    """Seconds per load (and redis save) and per same-size copy; the first repeat untimed."""
    times: dict[str, list[float]] = {"load": [], "save": []}
    copies: list[float] = []
    for i in range(repeats + 1):  # the first one handshakes / builds the pair: not timed
        prompt = [i * tokens + t for t in range(tokens)]
        out = p.call("prefill", f"p{i}", prompt, {"do_remote_decode": True})
        if connector == "redis":  # the save must land before the load reads it
            p.call("run_until", [f"p{i}"], 120, timeout=130)
            times["save"].append(p.call("held_seconds", f"p{i}"))
        d.call("load", f"d{i}", prompt + [1], out["params"])
        status = d.call("run_until", [f"d{i}"], 120, timeout=130)
        if f"d{i}" not in status["done_recving"]:
            raise RuntimeError(f"{connector}: load failed: {status['failed']}")
        times["load"].append(status["done_recving"][f"d{i}"])
        copies.append(copier.seconds())
        p.call("run_until", [f"p{i}"], 120, timeout=130)
        d.call("finish", f"d{i}")
    return {op: ts[1:] for op, ts in times.items()}, copies[1:]


def _row(base: dict[str, Any], op: str, ts: list[float], cs: list[float]) -> dict[str, Any]:
    median = statistics.median(ts)
    return {
        **base,
        "op": op,
        "median_s": median,
        "gbps": base["bytes"] / median / 1e9,
        "copy_gbps": base["bytes"] / statistics.median(cs) / 1e9,
        # per repeat, transfer and copy side by side: robust to the load drifting
        "ratio": statistics.median(c / t for t, c in zip(ts, cs, strict=True)),
        "times_s": ts,
        "copy_times_s": cs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connectors", default="nixl,nccl,redis")
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--mib", type=float, default=64, help="MiB per transfer (whole blocks)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--layout",
        choices=["contiguous", "scattered", "both"],
        default="contiguous",
        help="block ids as a fresh allocation (runs) or shuffled (one per block)",
    )
    ap.add_argument("--redis-url", default=None, help="use this server instead of a private one")
    ap.add_argument(
        "--redis-transport",
        default="tcp",
        help="private server only: tcp, unix or tcp,unix (a unix-socket URL, same server)",
    )
    ap.add_argument(
        "--gloo-connections", type=int, default=None, help="nccl (gloo): TCP connections per pair"
    )
    ap.add_argument("--out", default="bench_results/bench_transfer.json")
    args = ap.parse_args()

    connectors = [c for c in args.connectors.split(",") if c]
    redis = None
    if "redis" in connectors and args.redis_url is None:
        try:
            redis = RedisProcess()
        except RuntimeError as e:
            print(f"skipping redis: {e}")
            connectors.remove("redis")
    layouts = {"both": [False, True], "contiguous": [False], "scattered": [True]}[args.layout]
    rows: list[dict[str, Any]] = []
    try:
        for preset in args.presets.split(","):
            for dtype in args.dtypes.split(","):
                for connector, label, options in _variants(connectors, redis, args):
                    for scattered in layouts:
                        if redis is not None:
                            redis.flush()
                        for row in bench_one(
                            connector, preset, dtype, args.mib, args.repeats, scattered, options
                        ):
                            rows.append({**row, "connector": label})
                            _print_row(rows[-1], header=len(rows) == 1)
    finally:
        if redis is not None:
            redis.stop()
    _write(rows, Path(args.out))


def _variants(
    connectors: list[str], redis: RedisProcess | None, args: argparse.Namespace
) -> list[tuple[str, str, dict[str, Any]]]:
    """(connector, row label, connector options) per measured variant: redis once per
    transport, nccl with `--gloo-connections` when given."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    for connector in connectors:
        if connector == "nccl" and args.gloo_connections:
            out.append(("nccl", "nccl", {"gloo_connections": args.gloo_connections}))
        elif connector != "redis":
            out.append((connector, connector, {}))
        elif redis is None:
            out.append(("redis", "redis", {"url": args.redis_url, "wait_s": 0}))
        else:
            for transport in args.redis_transport.split(","):
                label = "redis" if transport == "tcp" else f"redis-{transport}"
                out.append(("redis", label, {"url": redis.urls[transport], "wait_s": 0}))
    return out


def _print_row(row: dict[str, Any], header: bool) -> None:
    cols = (
        "connector",
        "op",
        "preset",
        "dtype",
        "layout",
        "blocks",
        "MiB",
        "median ms",
        "GB/s",
        "copy GB/s",
        "ratio",
        "target",
    )
    widths = (10, 4, 5, 8, 10, 6, 7, 9, 6, 9, 5, 6)
    if header:
        print(" ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    target = row["target"]
    ok = "" if target is None else (" ok" if row["ratio"] >= target else " LOW")
    values = (
        row["connector"],
        row["op"],
        row["preset"],
        row["dtype"],
        row["layout"],
        str(row["blocks"]),
        f"{row['bytes'] / 2**20:.1f}",
        f"{row['median_s'] * 1e3:.2f}",
        f"{row['gbps']:.2f}",
        f"{row['copy_gbps']:.2f}",
        f"{row['ratio']:.2f}",
        f"{target}{ok}" if target is not None else "-",
    )
    print(" ".join(v.rjust(w) for v, w in zip(values, widths, strict=True)), flush=True)


def _write(rows: list[dict[str, Any]], out: Path) -> None:
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "loadavg": Path("/proc/loadavg").read_text().strip()
        if Path("/proc/loadavg").exists()
        else None,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        from importlib.metadata import version

        meta["nixl"] = version("nixl")
    except Exception:
        meta["nixl"] = None
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out} (loadavg {meta['loadavg']})")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [
        f"{r['connector']} {r['op']}\n{r['preset']} {r['dtype'][:4]} {r['layout'][:4]}"
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.7), 4))
    ax.bar(range(len(rows)), [r["ratio"] for r in rows])
    for i, r in enumerate(rows):
        if r["target"] is not None:
            ax.hlines(r["target"], i - 0.4, i + 0.4, colors="red")
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("GB/s / single-thread copy GB/s")
    ax.set_title("KV transfer between two processes (red: target)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
