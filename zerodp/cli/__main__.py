"""`python -m zerodp.cli ...`: the `zerodp` command without its console script."""

import sys

from zerodp.cli import main

sys.exit(main())
