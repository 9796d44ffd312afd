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
- a forward_backward (+ optim_step) and a sample sent together while both workers are at
  zero are both answered, with the twin's logprobs and the snapshot's tokens.

Both tests share one trained run (module fixture ``trained``) to keep the cold starts few.
"""

from __future__ import annotations

import os

import pytest

from test_faults import LOST_S, LR, _datum, _lps, _new_run, _run_id, _service, _step, _weights
from test_supervisor import processes, scrape, status_json, supervised_stack, wait_for
from test_trainer_resume import _assert_same

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from conftest import BASE_MODEL  # noqa: E402
from tolerances import TOL, check_close  # noqa: E402

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


@pytest.fixture(scope="module")
def trained(zstack):
    """An uninterrupted twin (5 steps), a run with 2 steps, a sampler snapshot of it and a
    seeded sample from the snapshot (the reference for samples after a cycle). ``steps``:
    how many steps the run has done (the tests below add theirs)."""
    svc = _service(zstack)
    ref = _new_run(svc)
    ref_lps = [_step(ref, i) for i in range(4)]
    ref_w4 = _weights(zstack, ref, "ref4")
    ref_lps.append(_step(ref, 4))
    tc = _new_run(svc)
    lps = [_step(tc, i) for i in range(2)]
    sc = tc.save_weights_and_get_sampling_client().result(timeout=LOST_S)  # a tinker:// snapshot
    prompt, params = types.ModelInput.from_ints([5, 6, 7, 8]), types.SamplingParams(max_tokens=6, seed=42)
    before = sc.sample(prompt, 2, params).result(timeout=LOST_S)
    return {"svc": svc, "ref_w4": ref_w4, "ref_lps": ref_lps, "tc": tc, "lps": lps, "steps": 2, "sc": sc,
            "sample": lambda: sc.sample(prompt, 2, params), "before": [s.tokens for s in before.sequences]}


def test_idle_stack_scales_to_zero_and_the_run_continues(zstack, trained, capsys):
    sup = zstack.supervisor
    tc, k = trained["tc"], trained["steps"]
    old = {name: sup.proc(name).pid for name in WORKERS}

    wait_zero(zstack)
    procs = processes(status_json(capsys, zstack))
    for name in WORKERS:
        assert procs[name]["state"] == "scaled to zero" and procs[name]["pid"] is None
        assert procs[name]["idle_s"] >= IDLE_S
    assert status_json(capsys, zstack)["supervisor"]["idle_timeout_s"] == IDLE_S
    assert 'openrl_function_processes{function="trainer"} 0.0' in scrape(zstack)

    lps = [_step(tc, i) for i in (k, k + 1)]  # the trainer starts again and restores the run
    trained["steps"] = k + 2
    assert sup.proc("trainer").pid != old["trainer"]
    trained["lps"] += lps
    if k + 2 == 4:  # the twin's weights were saved after 4 steps
        _assert_same(trained["lps"], trained["ref_lps"][:4], _weights(zstack, tc, "after-cycle"), trained["ref_w4"])
    else:  # the other test ran first: logprobs only
        for a, b in zip(trained["lps"], trained["ref_lps"]):
            check_close("restore", a, b, TOL.restore)
    log = (zstack.state_dir / "logs" / "trainer.log").read_text()
    assert f"restored run state of {_run_id(tc)} at cursor" in log  # from the flush its SIGTERM made

    after = trained["sample"]().result(timeout=LOST_S)  # the sampler starts again
    assert sup.proc("sampler").pid != old["sampler"]
    assert [s.tokens for s in after.sequences] == trained["before"]
    # scaling is no restart
    assert 'openrl_worker_restarts_total{function="trainer"} 0.0' in scrape(zstack)
    assert all(p["restarts"] == 0 for p in processes(status_json(capsys, zstack)).values())


def test_train_and_sample_requests_arriving_together_at_zero(zstack, trained):
    wait_zero(zstack)
    sup = zstack.supervisor
    at_zero = {name: sup.proc(name) for name in WORKERS}
    tc, k = trained["tc"], trained["steps"]
    fb = tc.forward_backward([_datum(k)], "cross_entropy")  # sent together with the sample
    opt = tc.optim_step(types.AdamParams(learning_rate=LR))
    sample = trained["sample"]()
    assert [s.tokens for s in sample.result(timeout=LOST_S).sequences] == trained["before"]
    opt.result(timeout=LOST_S)
    check_close("restore", _lps(fb), trained["ref_lps"][k], TOL.restore)
    trained["steps"] = k + 1
    assert all(sup.proc(name) is not at_zero[name] for name in WORKERS)  # both were started again
