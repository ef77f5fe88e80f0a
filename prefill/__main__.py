"""`python -m splitserve.prefill --config FLEET.yaml --index N`."""

import sys

from splitserve.prefill.role import main

sys.exit(main())
