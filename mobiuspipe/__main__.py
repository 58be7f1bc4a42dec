"""`python -m mobiuspipe`: the same command as the `mobiuspipe` console script."""

import sys

from mobiuspipe.cli import main

sys.exit(main())
