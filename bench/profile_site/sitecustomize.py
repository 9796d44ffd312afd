"""bench/stack_h200.py --profile-sampler: cProfile the embedded stack's sampler worker.

Put on PYTHONPATH with ``OPENRL_BENCH_PROFILE=DIR``; in a process started as
``python -m openrl.transport.worker functions.sampler ...`` it profiles the main thread (the event loop:
JetStream binding, handler, result writes, vLLM's output handler) from start to exit and writes
``DIR/sampler_<pid>.prof`` (pstats) when the worker exits on SIGTERM. Other processes: no effect.
"""

import os
import sys

_out = os.environ.get("OPENRL_BENCH_PROFILE")
if _out and "functions.sampler" in sys.argv[1:] + [os.environ.get("OPENRL_BENCH_PROFILE_ARGV", "")]:
    import atexit
    import cProfile

    _prof = cProfile.Profile()
    _prof.enable()

    def _dump() -> None:
        _prof.disable()
        _prof.dump_stats(os.path.join(_out, f"sampler_{os.getpid()}.prof"))

    atexit.register(_dump)
