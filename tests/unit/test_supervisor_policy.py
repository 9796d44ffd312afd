"""The supervisor's restart policy (openrl/transport/supervisor.py) on real child processes
(``sleep``), without NATS (``tick(None)``: no consumer is read, so nothing scales), and the
``openrl serve`` / ``openrl run`` flags and status file it goes with. The stack-level
behaviour (a SIGKILLed trainer, scale to zero) is in tests/stack/test_supervisor.py and
tests/stack/test_scale_to_zero.py."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from argparse import Namespace

import pytest
from prometheus_client import generate_latest

from openrl.transport.supervisor import FAILED, RESTARTING, RUNNING, STARTING, STOPPING, Backoff, Managed, Supervisor, describe_exit


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "600"])


@pytest.fixture
def procs():
    out: list = []
    yield out
    for p in out:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def _sup(procs, tmp_path, *names_critical) -> Supervisor:
    managed = []
    for i, (name, critical) in enumerate(names_critical):
        procs.append(_sleeper())
        managed.append(Managed(name, _sleeper, slot=i, critical=critical))
    return Supervisor(managed, procs, nats_url="nats://127.0.0.1:1", state_file=tmp_path / "supervisor.json",
                      backoff=Backoff(base_s=0.0, cap_s=0.0))


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait()


def test_backoff_doubles_up_to_the_cap():
    b = Backoff(base_s=0.5, cap_s=30.0)
    assert [b.delay(n) for n in (1, 2, 3, 4, 7, 8, 50)] == [0.5, 1.0, 2.0, 4.0, 30.0, 30.0, 30.0]


def test_exit_reasons():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-15) == "killed by SIGTERM"
    assert describe_exit(1) == "exit code 1"


def test_a_dead_worker_is_restarted_and_counted(procs, tmp_path):
    sup = _sup(procs, tmp_path, ("trainer", False), ("gateway", True))
    old, gw = procs[0], procs[1]
    _kill(old)
    asyncio.run(sup.tick(None))  # backoff 0 s: restarted in the same check
    m = sup.managed[0]
    assert m.state == RUNNING and m.restarts == 1 and m.last_exit == "killed by SIGKILL"
    new = sup.proc("trainer")
    assert new is not old and new.poll() is None and procs[0] is new
    assert procs[1] is gw and gw.poll() is None  # the others were left alone
    text = generate_latest(sup.registry).decode()
    assert 'openrl_worker_restarts_total{function="trainer"} 1.0' in text
    assert 'openrl_worker_restarts_total{function="gateway"} 0.0' in text
    state = json.loads((tmp_path / "supervisor.json").read_text())
    row = {p["name"]: p for p in state["processes"]}["trainer"]
    assert row["restarts"] == 1 and row["pid"] == new.pid and row["last_exit"] == "killed by SIGKILL"


def test_a_restart_waits_for_its_backoff(procs, tmp_path):
    sup = _sup(procs, tmp_path, ("sampler", False))
    sup.backoff = Backoff(base_s=60.0, cap_s=60.0)
    old = sup.proc("sampler")
    old.terminate()
    old.wait()
    asyncio.run(sup.tick(None))
    m = sup.managed[0]
    assert m.state == RESTARTING and m.restarts == 0 and m.last_exit == "killed by SIGTERM"
    assert m.restart_at - time.monotonic() > 50 and sup.proc("sampler") is old


def test_a_critical_process_dying_three_times_in_the_window_is_fatal(procs, tmp_path):
    sup = _sup(procs, tmp_path, ("nats", True), ("trainer", False))
    for i in range(3):
        _kill(sup.proc("nats"))
        asyncio.run(sup.tick(None))
        asyncio.run(sup.tick(None))
        if i < 2:
            assert sup.fatal is None and sup.proc("nats").poll() is None
    assert sup.fatal == "nats died 3 times within 60 s (last: killed by SIGKILL); stopping the stack"
    assert sup.fatal_event.is_set() and sup.managed[0].state == FAILED and sup.managed[0].restarts == 2
    assert json.loads((tmp_path / "supervisor.json").read_text())["fatal"] == sup.fatal


def test_deaths_outside_the_window_are_not_fatal(procs, tmp_path):
    sup = _sup(procs, tmp_path, ("gateway", True))
    sup.crash_window_s = 0.2
    for _ in range(4):
        _kill(sup.proc("gateway"))
        asyncio.run(sup.tick(None))
        asyncio.run(sup.tick(None))
        time.sleep(0.25)
    assert sup.fatal is None and sup.managed[0].restarts == 4


class _Loads(Supervisor):
    """A Supervisor whose consumer reads come from a dict instead of nats-server: the JetStream
    ``consumer_info`` numbers are the only input faked here (the real read is exercised by
    tests/stack/test_scale_to_zero.py)."""

    loads: dict[str, tuple[int, int, int, int]] = {}

    async def _load(self, js, m):
        return self.loads.get(m.name)


def test_a_worker_is_not_idle_while_its_peer_starts(procs, tmp_path):
    """The H200 sweep at --idle-timeout 30 (docs/benchmarks.md): the trainer was stopped while the
    sampler loaded vLLM, then the sampler while the trainer started, every RL step. A worker's idle
    clock is now held while the other worker is starting, and runs again once it pulls."""
    managed = []
    for i, name in enumerate(("trainer", "sampler")):
        procs.append(_sleeper())
        managed.append(Managed(name, _sleeper, slot=i, consumer=("OPENRL", name)))
    sup = _Loads(managed, procs, nats_url="nats://127.0.0.1:1", state_file=tmp_path / "supervisor.json",
                 idle_timeout_s=5.0)
    trainer, sampler = managed
    sampler.state = STARTING
    sup.loads = {"trainer": (0, 0, 1, 0), "sampler": (0, 0, 0, 0)}   # trainer pulls, idle; sampler loading
    trainer.last_busy = time.monotonic() - 60
    asyncio.run(sup.tick(None))
    assert trainer.state == RUNNING and procs[0].poll() is None   # held, not SIGTERMed
    assert time.monotonic() - trainer.last_busy < 1
    sup.loads["sampler"] = (0, 0, 1, 0)                           # the sampler pulls: up
    asyncio.run(sup.tick(None))
    assert sampler.state == RUNNING and trainer.state == RUNNING
    trainer.last_busy = sampler.last_busy = time.monotonic() - 60  # then both idle past the grace
    asyncio.run(sup.tick(None))
    assert trainer.state == STOPPING and sampler.state == STOPPING
    assert procs[0].wait(timeout=10) == -signal.SIGTERM and procs[1].wait(timeout=10) == -signal.SIGTERM


def test_negative_idle_timeout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="idle_timeout"):
        Supervisor([], [], nats_url="nats://x", state_file=tmp_path / "s.json", idle_timeout_s=-1)


def test_serve_flags(monkeypatch, tmp_path):
    from openrl.cli import build_parser
    from openrl.transport.embedded import _stack_from_args

    p = build_parser()
    args = p.parse_args(["serve", "--idle-timeout", "2.5", "--state-dir", str(tmp_path)])
    assert args.idle_timeout == 2.5
    s = _stack_from_args(args)
    assert s.supervise and s.idle_timeout == 2.5
    monkeypatch.setenv("OPENRL_IDLE_TIMEOUT", "7")
    s = _stack_from_args(p.parse_args(["run", "x.py", "--state-dir", str(tmp_path)]))
    assert s.supervise and s.idle_timeout == 7.0
    monkeypatch.delenv("OPENRL_IDLE_TIMEOUT")
    assert _stack_from_args(Namespace(state_dir=tmp_path)).idle_timeout == 1800.0
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--idle-timeout", "-1"])


def test_serve_sleeps_idle_workers_by_default(monkeypatch, tmp_path):
    """openrl serve / run: idle workers sleep after 60 s unless --sleep-after or OPENRL_SLEEP_AFTER
    says otherwise (0 included); the workers get it as OPENRL_SLEEP_AFTER. A worker started on its
    own (a Knative revision) keeps Settings' 0."""
    from openrl.cli import build_parser
    from openrl.config import Settings
    from openrl.transport.embedded import SERVE_SLEEP_AFTER, _stack_from_args

    monkeypatch.delenv("OPENRL_SLEEP_AFTER", raising=False)
    p = build_parser()
    s = _stack_from_args(p.parse_args(["serve", "--state-dir", str(tmp_path)]))
    assert s.sleep_after == SERVE_SLEEP_AFTER == 60.0 and s.env()["OPENRL_SLEEP_AFTER"] == "60.0"
    assert Settings().sleep_after == 0.0
    assert _stack_from_args(p.parse_args(["serve", "--sleep-after", "0", "--state-dir", str(tmp_path)])).sleep_after == 0
    monkeypatch.setenv("OPENRL_SLEEP_AFTER", "0")
    assert _stack_from_args(p.parse_args(["run", "x.py", "--state-dir", str(tmp_path)])).sleep_after == 0
    monkeypatch.setenv("OPENRL_SLEEP_AFTER", "12")
    s = _stack_from_args(p.parse_args(["serve", "--state-dir", str(tmp_path)]))
    assert s.sleep_after == 12 and s.env()["OPENRL_SLEEP_AFTER"] == "12.0"
    s = _stack_from_args(p.parse_args(["serve", "--sleep-after", "3", "--state-dir", str(tmp_path)]))
    assert s.sleep_after == 3


def test_status_reads_the_state_file_of_its_gateway_only(tmp_path):
    from openrl.cli.status import supervisor_state

    doc = {"gateway": "http://127.0.0.1:8000", "updated_unix": time.time(), "stopped": False, "processes": []}
    (tmp_path / "supervisor.json").write_text(json.dumps(doc))
    assert supervisor_state(tmp_path, "http://127.0.0.1:8000/")["stale"] is False
    assert supervisor_state(tmp_path, "http://127.0.0.1:9000") is None
    (tmp_path / "supervisor.json").write_text(json.dumps({**doc, "updated_unix": time.time() - 60}))
    assert supervisor_state(tmp_path, "http://127.0.0.1:8000")["stale"] is True
    assert supervisor_state(tmp_path / "nowhere", "http://127.0.0.1:8000") is None
