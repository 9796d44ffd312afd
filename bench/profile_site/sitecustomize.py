"""Profiling hooks for the embedded stack's processes (put this directory on PYTHONPATH).

bench/stack_h200.py --profile-sampler: cProfile the embedded stack's sampler worker.

Put on PYTHONPATH with ``OPENRL_BENCH_PROFILE=DIR``; in a process started as
``python -m openrl.transport.worker functions.sampler ...`` it profiles the main thread (the event loop:
JetStream binding, handler, result writes, vLLM's output handler) from start to exit and writes
``DIR/sampler_<pid>.prof`` (pstats) when the worker exits on SIGTERM. Other processes: no effect.

bench/stack_h200.py --stacks EVERY_S: a sampling profile of every Python process of the stack (the
``openrl serve`` CLI, its workers, and the processes they spawn or fork, such as vLLM's engine core, which
inherit the environment; a forked child starts its own thread, ``os.register_at_fork``): with ``OPENRL_BENCH_STACKS=DIR``, a daemon thread writes every thread's
Python stack (``sys._current_frames``, the main thread first) every ``OPENRL_BENCH_STACKS_EVERY`` seconds (default 0.5) to
``DIR/stacks_<pid>.txt`` for the first ``OPENRL_BENCH_STACKS_FOR`` seconds (default 240) of the
process, each sample headed ``@ <seconds since the process started>``. The thread needs the GIL, so
a C call that holds it delays the sample (and shows as a longer gap). faulthandler's
``dump_traceback_later`` is not used: its watchdog reads frames without the GIL and crashed
``openrl serve`` during an import (SIGSEGV, seen here). The file starts with one line
``# {"pid", "ppid", "t0" (unix s), "every", "argv"}``; bench/stack_samples.py turns the files into a
timeline per process.
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

_stacks = os.environ.get("OPENRL_BENCH_STACKS")
if _stacks:
    import json
    import threading
    import time

    def _sample(path: str, every: float, until: float) -> None:
        """Every ``every`` s: ``@ <s since start>``, then per thread (the main thread first) ``T <name>``
        and its frames, innermost first (at most 60); flushed after each sample (a stack is often
        stopped with SIGKILL)."""
        me = threading.get_ident()
        t0 = time.time()
        with open(path, "w") as fh:
            fh.write("# " + json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "t0": t0, "every": every,
                                         "argv": sys.argv[:6], "orig_argv": getattr(sys, "orig_argv", [])[:8]}) + "\n")
            while time.time() - t0 < until:
                time.sleep(every)
                main = threading.main_thread().ident
                names = {t.ident: t.name for t in threading.enumerate()}
                frames = sys._current_frames()
                lines = [f"@ {time.time() - t0:.3f}"]
                for ident in sorted(frames, key=lambda i: i != main):
                    if ident == me:
                        continue
                    lines.append(f"T {names.get(ident, ident)}")
                    frame, n = frames[ident], 0
                    while frame is not None and n < 60:
                        code = frame.f_code
                        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
                        frame, n = frame.f_back, n + 1
                del frames, frame
                fh.write("\n".join(lines) + "\n")
                fh.flush()

    def _start_sampling() -> None:
        os.makedirs(_stacks, exist_ok=True)
        threading.Thread(target=_sample, name="openrl-bench-stacks", daemon=True,
                         args=(os.path.join(_stacks, f"stacks_{os.getpid()}.txt"),
                               float(os.environ.get("OPENRL_BENCH_STACKS_EVERY", "0.5")),
                               float(os.environ.get("OPENRL_BENCH_STACKS_FOR", "240")))).start()

    _start_sampling()
    # a forked child (vLLM's engine core, forked from the sampler by default) has no copy of the thread:
    # it starts its own, its t0 the fork
    os.register_at_fork(after_in_child=_start_sampling)
