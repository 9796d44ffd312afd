"""``<state>/pids.json``: which processes a stack started, so that leftovers can be found and stopped.

The embedded stack (:class:`openrl.transport.embedded.Stack`) records its supervisor (the
``openrl serve`` / ``openrl run`` process) when it starts, and every child it spawns
(:func:`openrl.transport.tether.popen`), each with its start time so that a pid the system
gave to another process since is never taken for ours::

    {"supervisor": {"name": "supervisor", "pid": 4242, "started": 1767261000.12},
     "processes": [{"name": "nats", "pid": 4250, "started": ...}, ...]}

A clean stop removes the file. A new ``openrl serve`` on the same state directory calls
:func:`alive` and refuses to start while anything recorded still runs (:func:`describe` says
what, and how to stop it); ``openrl stop --state-dir DIR`` calls :func:`stop`.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

FILE = "pids.json"
_lock = threading.Lock()


@dataclass(frozen=True)
class Entry:
    """One recorded process: its role (``supervisor``, ``nats``, ``gateway``, ...), pid and
    start time (seconds since the epoch, as the system reports it)."""

    name: str
    pid: int
    started: float

    def process(self) -> psutil.Process | None:
        """The running process this entry names, or None (exited, or the pid now belongs to a
        process started at another time)."""
        try:
            p = psutil.Process(self.pid)
            if abs(p.create_time() - self.started) > 1.0 or p.status() == psutil.STATUS_ZOMBIE:
                return None
            return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None


def _entry(name: str, pid: int) -> Entry:
    return Entry(name, pid, psutil.Process(pid).create_time())


def _read(state_dir: Path) -> dict:
    try:
        doc = json.loads((Path(state_dir) / FILE).read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(state_dir: Path, doc: dict) -> None:
    f = Path(state_dir) / FILE
    tmp = f.with_name(f"{FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(f)


def entries(state_dir: Path) -> list[Entry]:
    """Every process recorded in ``<state_dir>/pids.json``, supervisor first (none: [])."""
    doc = _read(state_dir)
    rows = ([doc["supervisor"]] if isinstance(doc.get("supervisor"), dict) else []) + list(doc.get("processes") or [])
    out = []
    for r in rows:
        try:
            out.append(Entry(str(r["name"]), int(r["pid"]), float(r["started"])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def start(state_dir: Path) -> None:
    """Record this process as the supervisor of a new stack in ``state_dir`` (no children yet)."""
    with _lock:
        _write(state_dir, {"supervisor": asdict(_entry("supervisor", os.getpid())), "processes": []})


def add_child(state_dir: Path, name: str, pid: int) -> None:
    """Record child ``pid`` as ``name``; entries of processes that have exited are dropped."""
    try:
        new = _entry(name, pid)
    except psutil.NoSuchProcess:  # already gone: nothing to find later
        return
    with _lock:
        doc = _read(state_dir)
        kept = [r for r in entries(state_dir) if r.name != "supervisor" and r.process() is not None]
        doc["processes"] = [asdict(e) for e in kept if e.pid != pid] + [asdict(new)]
        _write(state_dir, doc)


def clear(state_dir: Path) -> None:
    """Forget the stack of ``state_dir`` (after a clean stop)."""
    with _lock:
        try:
            (Path(state_dir) / FILE).unlink()
        except FileNotFoundError:
            pass


def alive(state_dir: Path) -> list[Entry]:
    """The recorded processes of ``state_dir`` that still run, this process left out."""
    return [e for e in entries(state_dir) if e.pid != os.getpid() and e.process() is not None]


def describe(left: list[Entry], state_dir: Path) -> str:
    """One line for the user: what of the stack of ``state_dir`` still runs and how to stop it."""
    names = ", ".join(f"{e.name} (pid {e.pid})" for e in left)
    if any(e.name == "supervisor" for e in left):
        what = f"another openrl serve/run uses state dir {state_dir}: {names}"
    else:
        what = f"a previous stack of state dir {state_dir} is still partly running without its supervisor: {names}"
    return f"{what}; stop it with `openrl stop --state-dir {state_dir}`, or pick another --state-dir"


def stop(state_dir: Path, timeout_s: float = 30.0) -> list[Entry]:
    """Stop every recorded process of ``state_dir`` that still runs: SIGTERM to the supervisor
    first (it stops its children in order), then to the other processes, SIGKILL to whatever is
    left after ``timeout_s`` seconds. Removes the record when nothing is left.

    Returns:
        The entries that were running (and are stopped now).

    Raises:
        PermissionError: a process belongs to another user.
    """
    left = alive(state_dir)
    procs = {e: e.process() for e in left}
    procs = {e: p for e, p in procs.items() if p is not None}
    sup = [(e, p) for e, p in procs.items() if e.name == "supervisor"]
    rest = [(e, p) for e, p in procs.items() if e.name != "supervisor"]
    deadline = time.monotonic() + timeout_s
    for e, p in sup:
        _signal(p, signal.SIGTERM)
        psutil.wait_procs([p], timeout=max(0.0, deadline - time.monotonic()) / 2)
    for e, p in rest:
        _signal(p, signal.SIGTERM)
    _, still = psutil.wait_procs([p for _, p in sup + rest], timeout=max(0.1, deadline - time.monotonic()))
    for p in still:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(still, timeout=10)
    if not alive(state_dir):
        clear(state_dir)
    return list(procs)


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.NoSuchProcess:
        pass
    except psutil.AccessDenied as exc:
        raise PermissionError(f"pid {p.pid}: not allowed to signal it ({exc})") from None
