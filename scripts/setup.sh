#!/usr/bin/env bash
# Install splitserve and everything its tests need, on a fresh machine (idempotent).
# torch is pinned to the CPU wheel in the same pip call: unpinned, it pulls GBs of CUDA builds.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) \
            >/dev/null
    else
        echo "setup: redis-server not found and no apt-get; install Redis yourself" >&2
    fi
fi
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[test,nixl]"
