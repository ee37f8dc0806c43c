"""`python -m chunkwise_tools.loadtest`."""

import sys

from chunkwise_tools.loadtest.cli import main

sys.exit(main())
