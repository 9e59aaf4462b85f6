"""`python -m specstack`: the same as the `specstack` command."""

import sys

from .cli import main

sys.exit(main())
