"""``python -m ampkit fit ...``."""

import sys

from ampkit.cli import main

sys.exit(main())
