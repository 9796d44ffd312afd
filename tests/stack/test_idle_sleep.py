"""Idle sleep on one machine (issue 32 item 1): a worker with no request in flight for
``OPENRL_SLEEP_AFTER`` seconds sleeps (keeps its process, moves its weights and runs to host
memory) and the next request wakes it.

The stack is the one ``openrl serve --idle-timeout 0 --sleep-after 1`` starts; nothing is
mocked: real nats-server, gateway and worker processes, the unmodified ``tinker`` SDK. On this
CPU machine the move to host memory has nothing to move (the tensors already live there), so
what is checked is the cycle the product runs everywhere: the states ``openrl status`` reports,
that the processes are the same ones (sleeping is not scaling to zero), and that a run trained
across sleeps equals its twin trained without pauses, and a seeded sample from a snapshot is
the same before and after the sampler slept. The GPU move itself (``functions/trainer/residency.py``,
the backends' ``sleep()``) is exercised by the GPU conformance run.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_faults import LOST_S, _new_run, _service, _step
from test_supervisor import processes, status_json, supervised_stack, wait_for

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

SLEEP_AFTER_S = 1.0


@pytest.fixture(scope="module")
def sstack(tmp_path_factory, models_dir):
    s = supervised_stack(tmp_path_factory, models_dir, 0.0, OPENRL_SLEEP_AFTER=str(SLEEP_AFTER_S))
    yield s
    s.stop()


def _sleep_of(capsys, stack, function: str) -> dict | None:
    for w in status_json(capsys, stack)["workers"]:
        if w["function"] == function and w.get("sleep"):
            return w["sleep"]
    return None


def _wait_state(capsys, stack, function: str, state: str) -> dict:
    return wait_for(lambda: (s := _sleep_of(capsys, stack, function)) and s["state"] == state and s,
                    f"{function} {state}")


def test_workers_sleep_when_idle_and_wake_for_the_next_request(sstack, capsys):
    sup = sstack.supervisor
    svc = _service(sstack)
    twin, tc = _new_run(svc), _new_run(svc)
    want = [_step(twin, i) for i in range(3)]  # steps sent back to back

    got = [_step(tc, 0)]
    pids = {name: sup.proc(name).pid for name in ("trainer", "sampler")}
    slept = _wait_state(capsys, sstack, "trainer", "asleep")
    got.append(_step(tc, 1))  # answered, so the trainer woke for it (it may be asleep again by now: counters only)
    woke = wait_for(lambda: (s := _sleep_of(capsys, sstack, "trainer")) and s["wakes"] >= 1 and s, "trainer woke")
    assert woke["last_wake_s"] is not None and woke["error"] is None
    _wait_state(capsys, sstack, "trainer", "asleep")
    got.append(_step(tc, 2))
    for a, b in zip(got, want):  # the moves change no value: equal to the run that never slept
        np.testing.assert_array_equal(a, b)
    assert _sleep_of(capsys, sstack, "trainer")["sleeps"] >= slept["sleeps"] + 1

    sc = tc.save_weights_and_get_sampling_client().result(timeout=LOST_S)
    prompt, params = types.ModelInput.from_ints([5, 6, 7, 8]), types.SamplingParams(max_tokens=6, seed=42)
    before = [s.tokens for s in sc.sample(prompt, 2, params).result(timeout=LOST_S).sequences]
    _wait_state(capsys, sstack, "sampler", "asleep")
    after = [s.tokens for s in sc.sample(prompt, 2, params).result(timeout=LOST_S).sequences]
    assert after == before
    wait_for(lambda: (s := _sleep_of(capsys, sstack, "sampler")) and s["wakes"] >= 1, "sampler woke")

    # sleeping is not scaling to zero: the same processes, never restarted, reported running
    assert {name: sup.proc(name).pid for name in ("trainer", "sampler")} == pids
    procs = processes(status_json(capsys, sstack))
    assert all(procs[n]["state"] == "running" and procs[n]["restarts"] == 0 for n in ("trainer", "sampler"))
    log = (sstack.state_dir / "logs" / "trainer.log").read_text()
    assert "asleep: 0.00 GB of engine tensors moved to host memory" in log


def test_status_table_shows_the_sleep_state(sstack, capsys, monkeypatch):
    from openrl import cli

    monkeypatch.setenv("COLUMNS", "240")  # rich: one line per row
    _wait_state(capsys, sstack, "trainer", "asleep")
    rc = cli.main(["status", "--base-url", sstack.base_url, "--api-key", sstack.api_key,
                   "--state-dir", str(sstack.state_dir)])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith("│ trainer")]
    assert rows and "asleep" in rows[0], out
