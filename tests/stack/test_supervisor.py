"""The supervisor of ``openrl serve`` (issue 17 item 0): a dead process is restarted, not a
reason to stop the stack.

The stack is the one ``openrl serve`` starts (``Stack(supervise=True)``, as
``openrl.transport.embedded._stack_from_args`` builds it) with ``--idle-timeout 0`` (workers
always up), a 3 s JetStream ack wait (so the request a killed trainer held comes back
quickly) and 1 s periodic run-state flushes. Nothing is mocked: real nats-server, gateway and
worker processes, the unmodified ``tinker`` SDK, real signals.

- the trainer is SIGKILLed while it holds a forward_backward mid-pass (the test-only hold
  point of ``openrl/testhooks.py``): the supervisor restarts it, the request is redelivered
  and applied once on the restored state, so the run's logprobs and weights equal an
  uninterrupted twin's; the sampler and the gateway kept their processes; the restart is
  counted in the supervisor's ``/metrics`` and in ``openrl status``; the new trainer's own
  ``/metrics`` URL (a port it bound itself) is the one ``<state>/ports.json`` gives.
- the gateway dying three times within a minute stops the stack with a message naming it.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from conftest import _make_stack
from openrl import cli
from test_faults import (LOST_S, _hold, _lps, _new_run, _release, _run_id, _service, _step, _submit_step,
                         _wait_held, _weights)
from test_trainer_resume import _assert_same

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from conftest import BASE_MODEL  # noqa: E402
from openrl.storage import RUNSTATE_DIR  # noqa: E402


def wait_for(cond, what: str, timeout_s: float = 120.0):
    """Poll ``cond()`` until it returns a truthy value (a hang guard, not a speed check)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def supervised_stack(tmp_path_factory, models_dir, idle_timeout: float, **env):
    """A stack started as ``openrl serve --idle-timeout <idle_timeout>`` starts it, with a hold
    file for the hold points and ``env`` for its processes."""
    s = _make_stack(tmp_path_factory, models_dir, supervise=True, idle_timeout=idle_timeout, extra_env=env)
    s.extra_env["OPENRL_TEST_HOLD_FILE"] = str(s.state_dir / "hold")
    return s.start()


def scrape(stack) -> str:
    url = json.loads((stack.state_dir / "ports.json").read_text())["metrics"]["supervisor"]
    return httpx.get(url, timeout=10).text


def _trainer_metrics_url(stack) -> str | None:
    """The trainer's /metrics URL from ``<state>/ports.json`` when a trainer answers there, else None."""
    url = json.loads((stack.state_dir / "ports.json").read_text())["metrics"]["trainer"]
    try:
        r = httpx.get(url, timeout=10)
    except httpx.HTTPError:  # the killed trainer's port, before the new one recorded its own
        return None
    return url if r.status_code == 200 and 'function="trainer"' in r.text else None


def status_json(capsys, stack) -> dict:
    """``openrl status --json`` of the stack's gateway (in process, the real CLI)."""
    rc = cli.main(["status", "--json", "--base-url", stack.base_url, "--api-key", stack.api_key,
                   "--state-dir", str(stack.state_dir)])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def processes(status: dict) -> dict[str, dict]:
    return {p["name"]: p for p in status["supervisor"]["processes"]}


def _head_cursor(stack, run: str) -> int | None:
    f = stack.state_dir / "storage" / RUNSTATE_DIR / run / "HEAD.json"
    try:
        return json.loads(f.read_text())["cursor"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture(scope="module")
def sstack(tmp_path_factory, models_dir):
    s = supervised_stack(tmp_path_factory, models_dir, 0, OPENRL_ACK_WAIT_S="3", OPENRL_FLUSH_INTERVAL_S="1",
                         OPENRL_RESTORE_WAIT_S="1")
    yield s
    _release(s)
    s.stop()


def test_trainer_sigkilled_mid_run_is_restarted_and_the_run_goes_on(sstack, capsys):
    sup = sstack.supervisor
    svc = _service(sstack)
    ref = _new_run(svc)
    ref_lps = [_step(ref, i) for i in range(4)]
    ref_w = _weights(sstack, ref, "ref")

    tc = _new_run(svc)
    run = _run_id(tc)
    lps = [_step(tc, i) for i in range(2)]
    # create + 2 x (forward_backward, optim_step): cursor 5, flushed by the 1 s periodic flush
    wait_for(lambda: _head_cursor(sstack, run) == 5, "the periodic flush at cursor 5")
    trainer, sampler, gateway = sup.proc("trainer"), sup.proc("sampler"), sup.proc("gateway")

    _hold(sstack, "computed:forward_backward")
    fb, opt = _submit_step(tc, 2)
    _wait_held(sstack, "computed:forward_backward", trainer)
    trainer.send_signal(signal.SIGKILL)  # mid-pass: gradients in memory, message not acked
    trainer.wait(timeout=60)
    _release(sstack)

    opt.result(timeout=LOST_S)
    lps.append(_lps(fb))
    lps.append(_step(tc, 3))
    _assert_same(lps, ref_lps, _weights(sstack, tc, "after-kill"), ref_w)

    new = sup.proc("trainer")
    assert new.pid != trainer.pid and new.poll() is None
    # the new trainer bound a metrics port of its own and recorded it: the URL in ports.json answers
    url = wait_for(lambda: _trainer_metrics_url(sstack), "the restarted trainer's metrics URL in ports.json")
    assert sstack.metrics_urls["trainer"] == url
    # the others kept serving in their own processes
    assert sup.proc("sampler") is sampler and sampler.poll() is None
    assert sup.proc("gateway") is gateway and gateway.poll() is None
    sc = svc.create_sampling_client(base_model=BASE_MODEL).result(timeout=LOST_S)
    assert sc.sample(types.ModelInput.from_ints([1, 2, 3]), 1,
                     types.SamplingParams(max_tokens=2, seed=1)).result(timeout=LOST_S).sequences

    assert 'openrl_worker_restarts_total{function="trainer"} 1.0' in scrape(sstack)
    assert 'openrl_worker_restarts_total{function="sampler"} 0.0' in scrape(sstack)
    procs = processes(status_json(capsys, sstack))
    assert procs["trainer"]["restarts"] == 1 and procs["trainer"]["last_exit"] == "killed by SIGKILL"
    assert procs["trainer"]["pid"] == new.pid and procs["trainer"]["state"] in ("starting", "running")
    assert procs["sampler"]["restarts"] == 0 and procs["gateway"]["restarts"] == 0
    log = (sstack.state_dir / "logs" / "trainer.log").read_text()
    assert f"restored run state of {run} at cursor 5" in log


def test_status_tables_show_the_processes(sstack, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    rc = cli.main(["status", "--base-url", sstack.base_url, "--api-key", sstack.api_key,
                   "--state-dir", str(sstack.state_dir)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Processes (openrl serve supervisor: workers always up)" in out
    for name in ("nats", "gateway", "trainer", "sampler", "restarts", "last exit"):
        assert name in out, name


def test_gateway_dying_three_times_in_a_minute_stops_the_stack(sstack):
    """The gateway is restarted twice (the SDK would retry meanwhile); the third death within
    60 s is fatal: the stack reports which process (``openrl serve`` prints it and stops)."""
    sup = sstack.supervisor
    for i in range(3):
        gw = wait_for(lambda: (p := sup.proc("gateway")).poll() is None and p, "a live gateway")
        if i < 2:
            assert sstack.fatal is None
        os.kill(gw.pid, signal.SIGKILL)
        gw.wait(timeout=60)
        if i < 2:  # restarted: the new one answers
            wait_for(lambda: sup.proc("gateway") is not gw, "the gateway restart")
            sstack._wait_healthy()
    wait_for(lambda: sstack.fatal, "the supervisor to give up", timeout_s=30)
    assert sstack.fatal.startswith("gateway died 3 times within 60 s (last: killed by SIGKILL)")
    assert sup.fatal_event.is_set()
    state = json.loads((sstack.state_dir / "supervisor.json").read_text())
    assert state["fatal"] == sstack.fatal
    assert {p["name"]: p["state"] for p in state["processes"]}["gateway"] == "failed"
    assert 'openrl_worker_restarts_total{function="gateway"} 2.0' in scrape(sstack)
