"""``python examples/autoresearch ...``: run the driver (see driver.py)."""

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: rl_loop, text_to_sql, autoresearch

from autoresearch.driver import main  # noqa: E402

rc = main()
# The process ends here. Freezing what is left keeps the interpreter's shutdown collections from
# walking every object torch, transformers and matplotlib made (0.7-1 s on a 2-core VM); objects
# are still freed and atexit handlers still run, only cyclic garbage is left to the OS.
gc.freeze()
sys.exit(rc)
