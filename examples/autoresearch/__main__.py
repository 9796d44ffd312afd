"""``python examples/autoresearch ...``: run the driver (see driver.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: rl_loop, text_to_sql, autoresearch

from autoresearch.driver import main  # noqa: E402

sys.exit(main())
