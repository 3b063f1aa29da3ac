"""`python -m zoo`."""

import sys

from ._cli import main

sys.exit(main())
