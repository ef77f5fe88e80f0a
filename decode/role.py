"""The decode role: an engine whose KV connector is the consumer (loads the prefill instance's KV, then continues generation).

Everything but the role's name is shared with the other roles in `engine/fleet.py`.
"""

from __future__ import annotations

import argparse

from splitserve.engine.fleet import add_role_args, role_main, run_role

ROLE = "decode"


def main(argv: list[str] | None = None) -> int:
    return role_main(ROLE, argv)


def add_args(parser: argparse.ArgumentParser) -> None:
    add_role_args(parser)


def run(args: argparse.Namespace) -> int:
    return run_role(ROLE, args)
