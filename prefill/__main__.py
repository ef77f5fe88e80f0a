"""`python -m splitserve.prefill --config FLEET.yaml --index N`: alias of `splitserve prefill ...`."""

import sys

from splitserve.cli import main

sys.exit(main(["prefill", *sys.argv[1:]]))
