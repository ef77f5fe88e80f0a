"""`python -m splitserve.decode --config FLEET.yaml --index N`: alias of `splitserve decode ...`."""

import sys

from splitserve.cli import main

sys.exit(main(["decode", *sys.argv[1:]]))
