"""``python -m openrl.cli`` (the same as the ``openrl`` console script)."""

import sys

from openrl.cli import main

sys.exit(main())
