"""Test-only hold points, for the fault tests (``tests/stack/test_faults.py``).

``OPENRL_TEST_HOLD_FILE=<path>`` (unset in production: every hold point is then a no-op).
While ``<path>`` exists and lists a hold point's name (whitespace-separated), a process
reaching that point writes ``<path>.held`` (``<name> <pid>``) and waits until the file is
removed or no longer lists the name. A test can so stop a request exactly in the middle of
its handling and SIGKILL the worker, or restart another component, while it is held.

Hold points:

- ``computed:forward_backward``: the trainer, after a forward(_backward) pass has run on the
  device (gradients accumulated in memory) and before its results are returned (the run's
  seq_id cursor has not moved, the message is not acked); the engine lock is held.
- ``handle:<op>`` (e.g. ``handle:sample``): the JetStream binding, after it received the
  request and before the function handles it (the message is not acked).

Waiting happens in a thread (trainer) or with ``asyncio.sleep`` (binding), so the event
loop keeps sending in-progress acks.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

ENV = "OPENRL_TEST_HOLD_FILE"
POLL_S = 0.05


def enabled() -> bool:
    """True when a hold file is configured (tests only)."""
    return bool(os.environ.get(ENV))


def _listed(path: Path, name: str) -> bool:
    try:
        return name in path.read_text().split()
    except OSError:  # removed
        return False


def _mark(path: Path, name: str) -> None:
    tmp = path.with_name(path.name + f".held.{os.getpid()}")
    tmp.write_text(f"{name} {os.getpid()}\n")
    os.replace(tmp, path.with_name(path.name + ".held"))


def _held(name: str) -> Path | None:
    """The hold file if it lists ``name`` (marked as held), else None."""
    raw = os.environ.get(ENV)
    if not raw or not _listed(Path(raw), name):
        return None
    _mark(Path(raw), name)
    return Path(raw)


def hold(name: str) -> bool:
    """Block (polling) while the hold file lists ``name``. Returns True if it held."""
    path = _held(name)
    while path is not None and _listed(path, name):
        time.sleep(POLL_S)
    return path is not None


async def hold_async(name: str) -> bool:
    """:func:`hold` without blocking the event loop."""
    path = _held(name)
    while path is not None and _listed(path, name):
        await asyncio.sleep(POLL_S)
    return path is not None
