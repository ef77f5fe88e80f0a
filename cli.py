"""The `splitserve` command: `splitserve serve --model DIR [--config FILE] [flags]`.

An instance config file has two sections, the same schema the fleet configs use per instance:

```yaml
engine:            # EngineConfig: model, cache, scheduler, kv_transfer, device, num_threads, seed
  model: {model: models/tiny-llama, dtype: bfloat16}
  cache: {block_size: 16, kv_cache_memory: 512MiB}
server:            # ServerConfig: host, port, max_body_bytes, max_waiting, role
  port: 8000
```

Flags override the file. A bad config prints one line naming the field and exits with status 2.
Subcommands: `serve` (one colocated instance), and one per fleet role (`prefill`, `decode`,
`colocated`: instance `--index N` of a fleet file), and `router`; `python -m
splitserve.prefill|decode|router` are aliases.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from splitserve.engine.config import EngineConfig, build_config, load_yaml
from splitserve.engine.fleet import load_fleet
from splitserve.engine.server import ServerConfig

logger = logging.getLogger("splitserve")


class InstanceConfig(BaseModel):
    """One instance: its engine and its HTTP server."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: EngineConfig
    server: ServerConfig = Field(default_factory=ServerConfig)


# flag dest → (engine section or None for top level, field)
_ENGINE_FLAGS: dict[str, tuple[str | None, str]] = {
    "model": ("model", "model"),
    "dtype": ("model", "dtype"),
    "max_model_len": ("model", "max_model_len"),
    "served_model_name": ("model", "served_model_name"),
    "block_size": ("cache", "block_size"),
    "kv_cache_memory": ("cache", "kv_cache_memory"),
    "num_blocks": ("cache", "num_blocks"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "policy": ("scheduler", "policy"),
    "device": (None, "device"),
    "attention_backend": (None, "attention_backend"),
    "num_threads": (None, "num_threads"),
    "seed": (None, "seed"),
}
_SERVER_FLAGS = ("host", "port", "max_body_bytes", "max_waiting", "access_log")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by `serve`, `prefill` and `decode` (defaults come from the config)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", help="local HF-format model directory")
    g.add_argument("--config", help="instance config YAML (engine: and server: sections)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--served-model-name")
    g.add_argument("--block-size", type=int)
    g.add_argument("--kv-cache-memory", help="bytes for the KV cache, e.g. 512MiB")
    g.add_argument("--num-blocks", type=int, help="override the derived KV block count")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--policy", choices=["fcfs", "priority"])
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"])
    g.add_argument("--num-threads", type=int, help="torch threads of the engine core")
    g.add_argument("--seed", type=int)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host")
    g.add_argument("--port", type=int)
    g.add_argument("--max-body-bytes", type=int)
    g.add_argument("--max-waiting", type=int, help="waiting-queue bound (503 past it)")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )


def build_instance_config(args: argparse.Namespace, role: str | None = None) -> InstanceConfig:
    """File (if any) + flags → a validated InstanceConfig; ValueError names the bad field."""
    source = args.config or "command line"
    data = load_yaml(args.config) if args.config else {}
    unknown = sorted(set(data) - {"engine", "server"})
    if unknown:
        raise ValueError(
            f"invalid configuration in {source}: unknown section(s) "
            f"{', '.join(unknown)} (known: engine, server)"
        )
    engine = _section(data, "engine", source)
    server = _section(data, "server", source)
    for dest, (section, key) in _ENGINE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            target = engine if section is None else engine.setdefault(section, {})
            if not isinstance(target, dict):
                raise ValueError(
                    f"invalid configuration in {source}: engine.{section} must be a mapping"
                )
            target[key] = value
    for key in _SERVER_FLAGS:
        if getattr(args, key, None) is not None:
            server[key] = getattr(args, key)
    if role is not None:
        server["role"] = role
    if server.get("max_waiting") is not None and isinstance(engine.get("scheduler", {}), dict):
        engine.setdefault("scheduler", {})["max_waiting"] = server["max_waiting"]
    return build_config(InstanceConfig, {"engine": engine, "server": server}, source)


def _section(data: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    value = data.get(name) or {}
    if not isinstance(value, dict):
        raise ValueError(f"invalid configuration in {source}: {name} must be a mapping")
    return {k: dict(v) if isinstance(v, dict) else v for k, v in value.items()}


def run_instance(config: InstanceConfig, log_level: str) -> int:
    """Serve until SIGTERM/SIGINT; 0 on a clean stop, 1 if the engine could not start."""
    from splitserve.engine.async_llm import EngineDeadError
    from splitserve.engine.server import serve

    try:
        _run_async(serve(config.engine, config.server, log_level))
    except EngineDeadError as err:
        print(f"splitserve: error: {err}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):  # stopped while starting
        logger.info("stopped")
    return 0


def _run_async(coro: Any) -> Any:
    """uvloop when installed (it and httptools roughly halve the HTTP cost per token)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def cmd_serve(args: argparse.Namespace) -> int:
    config = build_instance_config(args)
    return run_instance(config, args.log_level)


def _add_serve(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_server_args(parser)


def add_role_args(parser: argparse.ArgumentParser) -> None:
    """`--config FILE --index N` (+ `--model`, `--log-level`) of `splitserve prefill|decode`."""
    parser.add_argument("--config", required=True, help="fleet config YAML")
    parser.add_argument("--index", type=int, default=0, help="instance index within the role")
    parser.add_argument("--model", help="override the fleet's model directory")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error", "critical"])


def run_role(role: str, args: argparse.Namespace) -> int:
    """Build instance `args.index` of `role` from the fleet file and serve it until stopped.

    The roles differ only in data (the fleet gives prefill `kv_role: producer`, decode
    `consumer`), so one entry point serves them all.
    """
    fleet = load_fleet(args.config, {"model": args.model} if args.model else None)
    data = fleet.instance_data(role, args.index)
    config = build_config(InstanceConfig, data, f"{args.config} ({role} {args.index})")
    return run_instance(config, args.log_level)


def _add_router(parser: argparse.ArgumentParser) -> None:
    from splitserve.router.__main__ import add_args

    add_args(parser)


def _run_router(args: argparse.Namespace) -> int:
    from splitserve.router.__main__ import run

    return run(args)


# name → (help, add arguments, run). `scripts/launch.py` runs
# `python -m splitserve.cli prefill|decode --config FLEET.yaml --index N`.
Subcommand = tuple[
    str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]
]
SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": ("serve one colocated instance (OpenAI-compatible HTTP)", _add_serve, cmd_serve),
    **{role: (f"one {role} instance of a fleet (--config FLEET.yaml --index N)", add_role_args,
              functools.partial(run_role, role))
       for role in ("prefill", "decode", "colocated")},
    "router": ("run the router of a fleet (--config FLEET.yaml [--port N])", _add_router,
               _run_router),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.run(args)
    except ValueError as err:  # configuration problems: one line, no traceback
        print(f"splitserve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
