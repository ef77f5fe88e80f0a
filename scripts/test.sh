#!/usr/bin/env bash
# The test command (README, .ci/run): install, then run the whole suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}" GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
export NIXL_LOG_LEVEL="${NIXL_LOG_LEVEL:-WARN}" TOKENIZERS_PARALLELISM=false
set +e
python3 -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; that is a failure here" >&2
fi
exit "$rc"
