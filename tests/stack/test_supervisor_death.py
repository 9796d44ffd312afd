"""``kill -9`` of ``openrl serve`` leaves nothing behind (issue 23 item 5).

The real ``openrl serve`` runs as its own process (``python -m openrl.cli serve``, workers
always up: ``--idle-timeout 0``) with the real nats-server, gateway, trainer and sampler.
Nothing is mocked:

- the sampler is SIGKILLed first, so that the supervisor restarts it (from one of its own
  threads, the case the parent-death signal is easiest to get wrong for);
- a second ``openrl serve`` on the same state dir refuses, naming the running stack;
- SIGKILL of the ``openrl serve`` process: every process it started exits (each gets its
  parent-death signal, openrl/transport/tether.py), the gateway's port is free again;
- a new ``openrl serve`` on the same state dir and port then starts, and ``openrl stop
  --state-dir`` stops it cleanly (exit 0, nothing left).

The waits are hang guards (60 s), not speed checks: the children normally go within a second.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from openrl.transport import pidfile
from openrl.transport.local_servers import PortHold

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")


def wait_for(cond, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def serve(state: Path, port: int, *extra: str) -> subprocess.Popen:
    log = open(state.parent / f"serve-{port}-{time.monotonic_ns()}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "openrl.cli", "serve", "--state-dir", str(state), "--port", str(port),
                             "--no-build", *extra], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "TINKER_TELEMETRY": "0"})


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def children(state: Path) -> dict[str, int]:
    """Recorded processes of the stack that run now, by name (the supervisor left out)."""
    return {e.name: e.pid for e in pidfile.alive(state) if e.name != "supervisor"}


def supervising(state: Path) -> bool:
    """The stack has started and its supervisor watches (restarts) every process."""
    try:
        doc = json.loads((state / "supervisor.json").read_text())
    except (OSError, ValueError):
        return False
    return not doc.get("stopped") and all(p["state"] == "running" for p in doc["processes"])


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def port():
    """A free port held for the whole test (:class:`PortHold`): both ``openrl serve`` get it, and
    nothing else can take it between the first one's death and the second one's start."""
    with PortHold() as hold:
        yield hold.port


def test_sigkill_of_openrl_serve_leaves_no_process(tmp_path, models_dir, port):
    state = tmp_path / "state"
    state.mkdir()
    (state / "models").symlink_to(models_dir, target_is_directory=True)
    sup = serve(state, port, "--idle-timeout", "0")
    started: list[int] = []
    try:
        wait_for(lambda: healthy(port) and supervising(state), "openrl serve to answer and supervise")
        kids = wait_for(lambda: (lambda k: k if set(k) == {"nats", "trainer", "sampler", "gateway"} else None)(
            children(state)), "the four processes in pids.json")
        started += kids.values()
        assert all(psutil.Process(p).ppid() == sup.pid for p in kids.values())
        # where its start went (issue 32): the seconds from the openrl serve command's start to its first spawn
        spawn_s = json.loads((state / "ports.json").read_text())["startup"]["serve_to_workers"]
        assert 0 < spawn_s < 120

        os.kill(kids["sampler"], signal.SIGKILL)  # the supervisor restarts it from its own thread
        new = wait_for(lambda: (lambda k: k.get("sampler") not in (None, kids["sampler"]) and k)(children(state)),
                       "the supervisor to restart the sampler")
        started.append(new["sampler"])

        other = subprocess.run([sys.executable, "-m", "openrl.cli", "serve", "--state-dir", str(state), "--port",
                                "0", "--no-build"], capture_output=True, text=True, timeout=120)
        assert other.returncode == 1 and "Traceback" not in other.stderr
        assert f"another openrl serve/run uses state dir {state}" in other.stderr
        assert f"supervisor (pid {sup.pid})" in other.stderr and "openrl stop --state-dir" in other.stderr

        sup.send_signal(signal.SIGKILL)
        sup.wait(timeout=30)
        procs = list(new.values())
        left = wait_for(lambda: [p for p in procs if psutil.pid_exists(p)
                                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE] == [] or None,
                        "every child of the killed openrl serve to exit", timeout_s=60)
        assert left is True
        assert pidfile.alive(state) == [] and not listening(port)
    finally:
        sup.kill()
        for p in started:
            if psutil.pid_exists(p):
                os.kill(p, signal.SIGKILL)

    # the next openrl serve on the same state dir and port starts, and openrl stop stops it
    again = serve(state, port)
    try:
        wait_for(lambda: healthy(port), "the second openrl serve to answer")
        kids = children(state)
        assert {"nats", "gateway"} <= set(kids)
        stop = subprocess.run([sys.executable, "-m", "openrl.cli", "stop", "--state-dir", str(state)],
                              capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert f"stopped supervisor (pid {again.pid})" in stop.stdout
        assert again.wait(timeout=60) == 0
        assert not any(psutil.pid_exists(p) for p in kids.values())
        assert not (state / pidfile.FILE).exists() and not listening(port)
        assert json.loads((state / "supervisor.json").read_text())["stopped"] is True
    finally:
        again.kill()
