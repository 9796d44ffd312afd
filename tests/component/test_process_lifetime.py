"""Processes that die with their supervisor (openrl/transport/tether.py) and the record that
finds what is left of a stack (openrl/transport/pidfile.py), with real processes and real
signals; nothing is mocked.

The "supervisor" here is a small Python process that starts children the way the embedded
stack does (:func:`openrl.transport.tether.popen`), one of them from a thread that has ended
by the time the supervisor is killed (the supervisor's restarts come from such threads).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from openrl.transport import pidfile, tether

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")


def gone_within(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """The pids still running after ``timeout_s`` seconds (a hang guard: they normally go at once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


SUPERVISOR = textwrap.dedent("""
    import json, sys, threading, time
    from pathlib import Path
    from openrl.transport import pidfile, tether
    state = Path(sys.argv[1])
    pidfile.start(state)
    a = tether.popen([sys.executable, "-c", "import time; time.sleep(600)"], name="direct", state_dir=state)
    box = {}
    t = threading.Thread(target=lambda: box.update(p=tether.popen(
        [sys.executable, "-c", "import signal, time; time.sleep(600)"], name="from-thread", state_dir=state)))
    t.start(); t.join()
    print(json.dumps([a.pid, box["p"].pid]), flush=True)
    time.sleep(600)
""")


def test_children_die_with_their_supervisor(tmp_path):
    """SIGKILL of the supervisor takes every tethered child with it, the one started from an
    ended thread too; the record names them all; afterwards nothing of the state dir runs."""
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        children = json.loads(sup.stdout.readline())
        assert all(psutil.pid_exists(p) for p in children)
        recorded = {e.name: e.pid for e in pidfile.entries(tmp_path)}
        assert recorded == {"supervisor": sup.pid, "direct": children[0], "from-thread": children[1]}
        assert {e.name for e in pidfile.alive(tmp_path)} == {"supervisor", "direct", "from-thread"}
        sup.send_signal(signal.SIGKILL)
        sup.wait(timeout=30)
        assert gone_within(children) == []
        assert pidfile.alive(tmp_path) == []
    finally:
        sup.kill()
        for p in children if "children" in locals() else []:
            if psutil.pid_exists(p):
                os.kill(p, signal.SIGKILL)


def test_tether_refuses_to_start_under_another_parent():
    """A child whose supervisor died before the death signal was armed exits instead of running
    as an orphan: the wrapper compares its parent with the pid it was given."""
    proc = subprocess.run([sys.executable, "-m", "openrl.transport.tether", "1", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "supervisor 1 is gone" in proc.stderr
    ok = subprocess.run([sys.executable, "-m", "openrl.transport.tether", str(os.getpid()), "--", sys.executable, "-c",
                         "print('ran')"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == "ran"
    bad = subprocess.run([sys.executable, "-m", "openrl.transport.tether", "x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "usage:" in bad.stderr


def test_stop_escalates_and_ignores_reused_pids(tmp_path):
    """``pidfile.stop`` SIGTERMs what is recorded, SIGKILLs a process that ignores SIGTERM after
    the timeout, and removes the record; an entry whose pid now belongs to a process started at
    another time is never signalled."""
    stubborn = subprocess.Popen([sys.executable, "-c",
                                 "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                 "print('up', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    polite = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert stubborn.stdout.readline() == "up\n" and polite.stdout.readline() == "up\n"
        pidfile.add_child(tmp_path, "gateway", stubborn.pid)
        pidfile.add_child(tmp_path, "nats", polite.pid)
        doc = json.loads((tmp_path / pidfile.FILE).read_text())
        doc["processes"].append({"name": "trainer", "pid": bystander.pid, "started": 1.0})  # same pid, other start
        (tmp_path / pidfile.FILE).write_text(json.dumps(doc))
        left = pidfile.alive(tmp_path)
        assert {e.name for e in left} == {"gateway", "nats"}
        line = pidfile.describe(left, tmp_path)
        assert "partly running without its supervisor" in line and f"gateway (pid {stubborn.pid})" in line
        assert f"openrl stop --state-dir {tmp_path}" in line
        stopped = pidfile.stop(tmp_path, timeout_s=2)
        assert {e.name for e in stopped} == {"gateway", "nats"}
        # gone, the one that ignores SIGTERM too (psutil reaped them: Popen no longer sees the signal)
        assert gone_within([stubborn.pid, polite.pid]) == []
        assert bystander.poll() is None, "a process that only shares a recorded pid was signalled"
        assert not (tmp_path / pidfile.FILE).exists()
        assert pidfile.stop(tmp_path) == []
    finally:
        for p in (stubborn, polite, bystander):
            p.kill()
            p.wait(timeout=30)


def test_tethered_command_line():
    cmd = tether.tethered(["nats-server", "-p", 4222])
    assert cmd[:3] == [sys.executable, "-m", "openrl.transport.tether"]
    assert cmd[3:] == [str(os.getpid()), "--", "nats-server", "-p", "4222"]
