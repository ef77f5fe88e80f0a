"""`python -m splitserve.decode --config FLEET.yaml --index N`."""

import sys

from splitserve.decode.role import main

sys.exit(main())
