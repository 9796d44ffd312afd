"""Scale to zero on one machine (issue 15 items 1 and 2), tested as a cycle.

The stack is the one ``openrl serve --idle-timeout 2`` starts (``Stack(supervise=True,
idle_timeout=2)``); nothing is mocked: real nats-server, gateway and worker processes, the
unmodified ``tinker`` SDK. Periodic run-state flushes keep their default (120 s), so what a
restarted trainer restores comes from the flush its SIGTERM made.

- a run trains, the stack goes idle, both worker processes exit (their pids are gone), the
  next request starts the trainer again, the run goes on from its restored state and its
  logprobs and weights equal an uninterrupted twin's; a sample from a snapshot saved before
  the cycle gives the same tokens after it (the sampler started from zero); ``openrl status``
  shows the functions scaled to zero with their idle time, and scaling is not a restart.
- a forward_backward and a sample sent together while both workers are at zero are both
  answered.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from test_faults import LOST_S, _datum, _lps, _new_run, _run_id, _service, _step, _weights
from test_supervisor import processes, scrape, status_json, supervised_stack, wait_for
from test_trainer_resume import _assert_same

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from conftest import BASE_MODEL  # noqa: E402

IDLE_S = 2.0
WORKERS = ("trainer", "sampler")


@pytest.fixture(scope="module")
def zstack(tmp_path_factory, models_dir):
    s = supervised_stack(tmp_path_factory, models_dir, IDLE_S)
    yield s
    s.stop()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_zero(stack) -> None:
    """Wait until the trainer and the sampler are scaled to zero (their processes exited)."""
    sup = stack.supervisor
    wait_for(lambda: all(m.state == "scaled to zero" for m in sup.managed if m.name in WORKERS),
             "both workers scaled to zero")
    for name in WORKERS:
        p = sup.proc(name)
        assert p.poll() is not None and _gone(p.pid), f"{name} (pid {p.pid}) still runs"


def test_idle_stack_scales_to_zero_and_the_run_continues(zstack, capsys):
    sup = zstack.supervisor
    svc = _service(zstack)
    ref = _new_run(svc)
    ref_lps = [_step(ref, i) for i in range(4)]
    ref_w = _weights(zstack, ref, "ref")

    tc = _new_run(svc)
    lps = [_step(tc, i) for i in range(2)]
    sc = tc.save_weights_and_get_sampling_client("snap").result(timeout=LOST_S)  # tinker:// snapshot
    prompt, params = types.ModelInput.from_ints([5, 6, 7, 8]), types.SamplingParams(max_tokens=6, seed=42)
    before = sc.sample(prompt, 2, params).result(timeout=LOST_S)
    old = {name: sup.proc(name).pid for name in WORKERS}

    wait_zero(zstack)
    procs = processes(status_json(capsys, zstack))
    for name in WORKERS:
        assert procs[name]["state"] == "scaled to zero" and procs[name]["pid"] is None
        assert procs[name]["idle_s"] >= IDLE_S
    assert status_json(capsys, zstack)["supervisor"]["idle_timeout_s"] == IDLE_S
    assert 'openrl_function_processes{function="trainer"} 0.0' in scrape(zstack)

    lps += [_step(tc, i) for i in (2, 3)]  # the trainer starts again and restores the run
    assert sup.proc("trainer").pid != old["trainer"]
    _assert_same(lps, ref_lps, _weights(zstack, tc, "after-cycle"), ref_w)
    log = (zstack.state_dir / "logs" / "trainer.log").read_text()
    assert f"restored run state of {_run_id(tc)} at cursor 6" in log  # the SIGTERM flush (create, 2 steps, the save)

    after = sc.sample(prompt, 2, params).result(timeout=LOST_S)  # the sampler starts again
    assert sup.proc("sampler").pid != old["sampler"]
    assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]
    # scaling is no restart
    assert 'openrl_worker_restarts_total{function="trainer"} 0.0' in scrape(zstack)
    assert all(p["restarts"] == 0 for p in processes(status_json(capsys, zstack)).values())


def test_train_and_sample_requests_arriving_together_at_zero(zstack):
    svc = _service(zstack)
    sc = svc.create_sampling_client(base_model=BASE_MODEL).result(timeout=LOST_S)
    prompt, params = types.ModelInput.from_ints([9, 10, 11]), types.SamplingParams(max_tokens=4, seed=3)
    ref = sc.sample(prompt, 1, params)  # concurrent with the run's creation: one cold start each
    tc = _new_run(svc)
    ref = ref.result(timeout=LOST_S)
    wait_zero(zstack)
    sup = zstack.supervisor
    at_zero = {name: sup.proc(name) for name in WORKERS}

    fb = tc.forward_backward([_datum(0)], "cross_entropy")
    sample = sc.sample(prompt, 1, params)
    got = sample.result(timeout=LOST_S)
    lp = _lps(fb)
    assert lp.shape == (23,) and np.isfinite(lp).all() and (lp < 0).all()
    assert got.sequences[0].tokens == ref.sequences[0].tokens
    assert all(sup.proc(name) is not at_zero[name] for name in WORKERS)  # both were started again
