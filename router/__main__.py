"""`python -m splitserve.router --config FLEET.yaml [--port N]` (also `splitserve router`)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys

import uvicorn

from splitserve.engine.fleet import load_fleet


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="fleet config YAML")
    parser.add_argument("--port", type=int, help="override router.port")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error", "critical"])


def run(args: argparse.Namespace) -> int:
    from splitserve.router.app import build_fleet_app

    overrides = {"router": {"port": args.port}} if args.port else None
    try:
        fleet = load_fleet(args.config, overrides)
    except ValueError as err:
        print(f"splitserve router: error: {err}", file=sys.stderr)
        return 2
    app = build_fleet_app(fleet)
    # uvloop and httptools explicitly: "auto" falls back to asyncio/h11 silently. No proxy-headers
    # middleware: nothing here reads the client address, and it would wrap every request.
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    uvicorn.run(app, host=fleet.router.host, port=fleet.router.port, loop=loop,
                http="httptools", proxy_headers=False, log_level=args.log_level,
                access_log=False, timeout_graceful_shutdown=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitserve.router", description=__doc__)
    add_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
