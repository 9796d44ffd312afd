"""Workers that cannot start (openrl/transport/supervisor.py, openrl/transport/startfailures.py):
the cause read from the worker's log, the switch to ``failing`` after a few failed starts with
the same cause, the slower retry, and the recovery once a start pulls.

Real child processes (``sh``) write the log lines a worker writes and exit; no NATS
(``tick(None)``). The JetStream ``consumer_info`` numbers that say whether a worker pulls are
the only input faked (as in test_supervisor_policy.py); draining a real queue is in
tests/component/test_failing_drain.py, the whole stack in tests/stack/test_unstartable.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest
from prometheus_client import generate_latest

from openrl.transport.startfailures import read_start_error, same_cause, start_error
from openrl.transport.supervisor import FAILING, RESTARTING, RUNNING, STARTING, Backoff, Managed, Supervisor

TRACEBACK = """{"ts": "x", "level": "INFO", "msg": "metrics on :1/metrics"}
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/openrl/transport/worker.py", line 12, in <module>
    from openrl.transport.bindings import load_function
ModuleNotFoundError: No module named 'vllm._C'
"""


def test_the_cause_of_a_failed_start():
    marked = '{"level": "ERROR", "msg": "[functions.sampler] start failed: X"}\n' \
             "[functions.sampler] start failed: RegistryError: models.toml is not valid TOML: line 1\n" \
             "Traceback (most recent call last):\nKeyError: 'late'\n"
    assert start_error(marked) == "RegistryError: models.toml is not valid TOML: line 1"
    assert start_error(TRACEBACK) == "ModuleNotFoundError: No module named 'vllm._C'"
    assert start_error("Fatal Python error: Segmentation fault\n\nThread 0x1 (most recent call first):\n") == \
        "Fatal Python error: Segmentation fault"
    assert start_error('{"level": "INFO", "msg": "a"}\n{"level": "ERROR", "msg": "cannot bind\\ndetail"}\n') == \
        "cannot bind"
    assert start_error('{"level": "INFO", "msg": "loading"}\n') is None and start_error("") is None
    assert same_cause("OSError: port 4222 in use (pid 17)", "OSError: port 5001 in use (pid 9)")
    assert not same_cause("ValueError: a", "ValueError: b") and not same_cause(None, "x")


def test_only_the_current_process_output_is_read(tmp_path):
    log = tmp_path / "w.log"
    log.write_text("ValueError: from an earlier run\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write('{"level": "INFO", "msg": "starting"}\n')
    assert read_start_error(log, offset) is None
    assert read_start_error(log, 0) == "ValueError: from an earlier run"
    assert read_start_error(tmp_path / "missing.log", 0) is None


class _Pulls(Supervisor):
    """A Supervisor whose consumer reads come from ``self.waiting`` instead of nats-server."""

    waiting = 0

    async def _load(self, js, m):
        return (0, 0, self.waiting, 0)  # (pending, ack pending, waiting pulls, delivered)


@pytest.fixture
def procs():
    out: list = []
    yield out
    for p in out:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def _worker(log, line: str):
    """A spawn function: a process that writes ``line`` to ``log`` (as a worker's output goes there) and exits 3."""
    def spawn() -> subprocess.Popen:
        with open(log, "ab") as out:
            return subprocess.Popen(["sh", "-c", f"echo '{line}'; exit 3"], stdout=out, stderr=subprocess.STDOUT)
    return spawn


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "600"])


def _supervisor(procs, tmp_path, spawn) -> tuple[Supervisor, Managed]:
    log = tmp_path / "sampler.log"
    procs.append(spawn())
    m = Managed("sampler", spawn, slot=0, consumer=("OPENRL_SAMPLE", "sampler"), state=STARTING, log=log)
    sup = _Pulls([m], procs, nats_url="nats://127.0.0.1:1", state_file=tmp_path / "supervisor.json",
                 backoff=Backoff(base_s=0.0, cap_s=0.0), start_failures=3, failing_retry_s=3600)
    return sup, m


def _die_and_tick(sup: Supervisor, m: Managed) -> None:
    sup.procs[m.slot].wait(timeout=30)
    asyncio.run(sup.tick(None))


def test_a_worker_failing_its_start_three_times_with_one_cause_is_failing_then_recovers(procs, tmp_path):
    cause = "ValueError: OPENRL_DEVICE=cuda:7: torch sees 0 CUDA devices (pid 4242)"
    line = f"[functions.sampler] start failed: {cause}"
    sup, m = _supervisor(procs, tmp_path, _worker(tmp_path / "sampler.log", line))
    for n in (1, 2):
        _die_and_tick(sup, m)  # died while starting; backoff 0 s: started again in the same check
        assert m.failing is None and m.start_fails == n and m.state == STARTING and m.cause == cause
    _die_and_tick(sup, m)
    assert m.failing == cause and m.state == RESTARTING
    assert m.restart_at - time.monotonic() > 3000  # the slower schedule, not the backoff
    assert 'openrl_function_failing{function="sampler"} 1.0' in generate_latest(sup.registry).decode()
    row = json.loads((tmp_path / "supervisor.json").read_text())["processes"][0]
    assert row["state"] == FAILING and row["error"] == cause and row["last_exit"] == "exit code 3"
    msg = sup.failing_message(m)
    assert msg.startswith(f"the sampler worker cannot start: {cause} (3 failed starts in a row; "
                          "openrl serve tries again every 3600 s; its log: ")

    m.spawn, m.restart_at = _sleeper, 0.0  # the cause is gone; the next attempt is due
    asyncio.run(sup.tick(None))  # started; it does not pull yet: still failing
    assert m.state == STARTING and m.failing == cause
    assert json.loads((tmp_path / "supervisor.json").read_text())["processes"][0]["state"] == FAILING
    sup.waiting = 1  # it pulls: up
    asyncio.run(sup.tick(None))
    assert m.state == RUNNING and m.failing is None and m.start_fails == 0
    assert 'openrl_function_failing{function="sampler"} 0.0' in generate_latest(sup.registry).decode()
    row = sup.snapshot()["processes"][0]
    assert row["state"] == RUNNING and row["error"] is None


def test_starts_failing_with_changing_causes_are_failing_after_twice_as_many(procs, tmp_path):
    log = tmp_path / "sampler.log"
    n = {"i": 0}

    def spawn():
        n["i"] += 1
        return _worker(log, f"[functions.sampler] start failed: RuntimeError: cause {'abcdefgh'[n['i']]}")()

    sup, m = _supervisor(procs, tmp_path, spawn)
    for _ in range(5):
        _die_and_tick(sup, m)
        assert m.failing is None and m.start_fails == 1
    _die_and_tick(sup, m)
    assert m.failing is not None and m.failing.startswith("RuntimeError: cause") and m.any_start_fails == 6


def test_a_worker_that_ran_and_died_is_only_restarted(procs, tmp_path):
    sup, m = _supervisor(procs, tmp_path, _worker(tmp_path / "sampler.log", "ValueError: boom"))
    m.state = RUNNING  # it pulled before: a crash, not a failed start
    for _ in range(4):
        _die_and_tick(sup, m)
        m.state = RUNNING
    assert m.failing is None and m.start_fails == 0 and m.restarts == 4


def test_a_start_that_wrote_nothing_names_its_exit(procs, tmp_path):
    def spawn():
        return subprocess.Popen(["sh", "-c", "kill -9 $$"])

    sup, m = _supervisor(procs, tmp_path, spawn)
    for _ in range(3):
        _die_and_tick(sup, m)
    assert m.failing == "the process ended (killed by SIGKILL) before it took requests"


def test_bad_policy_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="OPENRL_START_FAILURES"):
        Supervisor([], [], nats_url="nats://x", state_file=tmp_path / "s.json", start_failures=0)
    with pytest.raises(ValueError, match="OPENRL_FAILING_RETRY_S"):
        Supervisor([], [], nats_url="nats://x", state_file=tmp_path / "s.json", failing_retry_s=0)
