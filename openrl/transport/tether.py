"""Processes that die with their supervisor: the Linux parent-death signal for every child.

Every process of the embedded stack (nats-server, gateway, trainer, sampler, dispatcher) is
started by :func:`popen` as::

    python -m openrl.transport.tether <supervisor pid> -- <command ...>

That small wrapper asks the kernel to send it ``SIGTERM`` when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), checks that its parent is still ``<supervisor pid>`` (if the
supervisor died between the fork and the ``prctl``, it exits at once instead of running as an
orphan), and then ``exec``\\ s the command: the same process id, and the death signal survives
the ``exec``. So a ``kill -9`` of ``openrl serve``, an OOM kill or a closed terminal takes the
whole stack down with it: each child gets ``SIGTERM`` and stops as on a normal shutdown (a
worker drains and the trainer flushes its run state; nats-server flushes JetStream).

The kernel sends the signal when the *thread* that forked the child exits, not the process.
The supervisor restarts processes from worker threads that come and go, so :func:`popen` runs
every ``fork`` on one thread that lives as long as the process (``openrl-spawner``).

Elsewhere than Linux there is no parent-death signal: the wrapper only runs the command, and
``openrl stop --state-dir`` (:mod:`openrl.transport.pidfile`) stops what is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: What a child gets when its supervisor dies: a graceful stop (see the module doc).
DEATH_SIGNAL = signal.SIGTERM

_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def tethered(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so that it dies with this process (see the module doc)."""
    return [sys.executable, "-m", "openrl.transport.tether", str(os.getpid()), "--", *map(str, cmd)]


def _executor() -> ThreadPoolExecutor:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            # one thread for the whole process, never shut down before exit: the children's
            # parent-death signal is tied to it
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openrl-spawner")
        return _spawner


def popen(cmd: list[str], *, name: str, state_dir: Path | None = None, **kwargs) -> subprocess.Popen:
    """Start ``cmd`` as a tethered child (``subprocess.Popen(tethered(cmd), **kwargs)``) from the
    spawner thread, and record it in ``<state_dir>/pids.json`` under ``name`` (when given), where
    ``openrl stop`` and the next ``openrl serve`` find it.

    Raises:
        OSError: the Python interpreter could not be started (as ``subprocess.Popen``).
    """
    proc = _executor().submit(subprocess.Popen, tethered(cmd), **kwargs).result()
    if state_dir is not None:
        from openrl.transport import pidfile

        pidfile.add_child(state_dir, name, proc.pid)
    return proc


def _set_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False where there is no such call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return True


def main(argv: list[str] | None = None) -> None:
    """The wrapper: ``python -m openrl.transport.tether PARENT_PID -- COMMAND...`` (module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        raise SystemExit("usage: python -m openrl.transport.tether PARENT_PID -- COMMAND [ARG...]")
    parent, cmd = int(argv[0]), argv[2:]
    _set_death_signal(DEATH_SIGNAL)
    if os.getppid() != parent:  # the supervisor died before the death signal was armed
        raise SystemExit(f"openrl: supervisor {parent} is gone; not starting {cmd[0]}")
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
