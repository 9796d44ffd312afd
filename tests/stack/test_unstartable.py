"""Fail fast when a worker cannot start, and isolate the cause (issue 22 item 5; invariant 10).

One stack, started as ``openrl serve --idle-timeout 0 --model Qwen/...=<tiny> --model
Bad/Model=<truncated copy>`` starts it: the tiny model and, registered beside it in
``<state>/models.toml``, a copy whose ``model.safetensors`` is cut short (the registry check of
``openrl models add`` reads no weights, so it is accepted). Start attempts of a failing worker
come every 2 s here (``OPENRL_FAILING_RETRY_S``; 60 s by default). Nothing is mocked: real
nats-server, gateway, worker processes and supervisor, the unmodified ``tinker`` SDK, real files.

- the model that cannot load: both workers preload it and stay up (no restart); its
  create_model, sample and compute_logprobs fail with category "server" and the load error's
  first line, each without a new load attempt (one per worker, logged); ``openrl status`` lists
  it; the tiny model trains, saves and samples meanwhile; once the directory is fixed, the next
  request loads it.
- a worker that cannot start: ``<state>/models.toml`` stops being TOML (a real setting every
  worker start reads) and the sampler is killed; its restarts die at start, and after three
  the sampler is ``failing``: a sample queued meanwhile and a new one fail with category
  "server" and the start error, ``openrl status`` shows the error, the trainer keeps training;
  once the file is fixed, the next attempt starts and sampling works again.
"""

from __future__ import annotations

import json
import shutil
import signal

import pytest

from conftest import BASE_MODEL, _make_stack
from openrl import cli
from openrl.model.registry import add_model
from test_errors import _future_error
from test_faults import LOST_S, _new_run, _step
from test_supervisor import processes, status_json, wait_for

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

BAD = "Bad/Model"
LOAD_ERROR = "SafetensorError: Error while deserializing header"
PROMPT = types.ModelInput.from_ints([11, 12, 13, 14])


def _truncated_copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    data = (src / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 40])
    return dst


@pytest.fixture(scope="module")
def ustack(tmp_path_factory, models_dir):
    good = models_dir / "tiny-qwen3"
    bad = _truncated_copy(good, tmp_path_factory.mktemp("bad") / "bad-model")
    s = _make_stack(tmp_path_factory, models_dir, supervise=True, idle_timeout=0, preload=[BASE_MODEL, BAD],
                    extra_env={"OPENRL_FAILING_RETRY_S": "2", "OPENRL_MODEL_RETRY_S": "3600"})
    add_model(BAD, str(bad), models_dir=s.state_dir / "models")  # what --model Bad/Model=DIR writes
    s.bad_dir, s.good_dir = bad, good
    s.start()
    yield s
    s.stop()


def _service(stack):
    return tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)


def _sample(sc):
    return sc.sample(PROMPT, 1, types.SamplingParams(max_tokens=3, seed=5))


def _fails(fn, *expected: str) -> str:
    """Run ``fn`` (an SDK call and its ``.result``) and return its failed future's error, which
    must have category "server" and contain each of ``expected``."""
    with pytest.raises(tinker.RequestFailedError) as e:
        fn()
    err = _future_error(e.value)
    assert e.value.category == "server", (e.value.category, err)
    for s in expected:
        assert s in err, err
    return err


def _load_attempts(stack, name: str) -> int:
    """Failed loads of Bad/Model logged by the worker (one record per attempt)."""
    return (stack.state_dir / "logs" / f"{name}.log").read_text().count(f'"base model {BAD} cannot be loaded from')


def _all_running(stack) -> dict:
    rows = {p["name"]: p for p in stack.supervisor.snapshot()["processes"]}
    return rows if rows["trainer"]["state"] == rows["sampler"]["state"] == "running" else {}


def test_a_model_that_cannot_load_fails_its_own_requests_only(ustack, capsys):
    sup = ustack.supervisor
    wait_for(lambda: _all_running(ustack), "both workers pulling", timeout_s=LOST_S)
    trainer, sampler = sup.proc("trainer"), sup.proc("sampler")
    svc = _service(ustack)
    where = f"cannot be loaded from {ustack.bad_dir}: {LOAD_ERROR}"

    err = _fails(lambda: svc.create_lora_training_client(base_model=BAD, rank=4).result(timeout=LOST_S),
                 f"base model '{BAD}' {where}")
    assert "OPENRL_MODEL_RETRY_S" in err
    bad_sc = svc.create_sampling_client(base_model=BAD).result(timeout=LOST_S)
    _fails(lambda: _sample(bad_sc).result(timeout=LOST_S), where)
    _fails(lambda: bad_sc.compute_logprobs(PROMPT).result(timeout=LOST_S), where)
    _fails(lambda: _sample(bad_sc).result(timeout=LOST_S), where)
    # each worker tried once (its preload); the requests got the kept failure
    assert _load_attempts(ustack, "trainer") == 1 and _load_attempts(ustack, "sampler") == 1

    # the good model trains and samples beside it
    tc = _new_run(svc)
    _step(tc, 0)
    _step(tc, 1)
    sc = tc.save_weights_and_get_sampling_client().result(timeout=LOST_S)
    assert _sample(sc).result(timeout=LOST_S).sequences[0].tokens
    assert len(sc.compute_logprobs(PROMPT).result(timeout=LOST_S)) == 4

    # the workers never restarted
    assert sup.proc("trainer") is trainer and trainer.poll() is None
    assert sup.proc("sampler") is sampler and sampler.poll() is None
    status = status_json(capsys, ustack)
    procs = processes(status)
    assert procs["trainer"]["restarts"] == procs["sampler"]["restarts"] == 0
    failed = {w["function"]: w.get("models_failed") for w in status["workers"]}
    assert failed["trainer"].startswith(f"{BAD}: {LOAD_ERROR}") and failed["sampler"].startswith(f"{BAD}: {LOAD_ERROR}")

    # fixed files: the next request loads the model (its directory changed)
    shutil.copy(ustack.good_dir / "model.safetensors", ustack.bad_dir / "model.safetensors")
    fixed = svc.create_lora_training_client(base_model=BAD, rank=4).result(timeout=LOST_S)
    _step(fixed, 0)
    fixed_sc = svc.create_sampling_client(base_model=BAD).result(timeout=LOST_S)
    assert _sample(fixed_sc).result(timeout=LOST_S).sequences[0].tokens
    assert sup.proc("trainer") is trainer and sup.proc("sampler") is sampler


def test_a_worker_that_cannot_start_fails_its_requests_with_the_cause_then_recovers(ustack, capsys, monkeypatch):
    sup = ustack.supervisor
    wait_for(lambda: _all_running(ustack), "both workers pulling", timeout_s=LOST_S)
    svc = _service(ustack)
    tc = _new_run(svc)
    sc = svc.create_sampling_client(base_model=BASE_MODEL).result(timeout=LOST_S)
    trainer = sup.proc("trainer")

    overlay = ustack.state_dir / "models.toml"
    kept = overlay.read_text()
    overlay.write_text("this is not TOML\n")
    try:
        old = sup.proc("sampler")
        old.send_signal(signal.SIGKILL)
        old.wait(timeout=60)
        queued = _sample(sc)  # waits in the queue while the sampler starts, then fails
        cause = f"RegistryError: model registry {overlay} is not valid TOML"
        _fails(lambda: queued.result(timeout=LOST_S), "the sampler worker cannot start: " + cause,
               "failed starts in a row", "sampler.log")
        row = wait_for(lambda: (r := processes(status_json(capsys, ustack))["sampler"])["state"] == "failing" and r,
                       "the sampler shown failing", timeout_s=LOST_S)
        assert row["error"].startswith(cause) and row["restarts"] >= 3
        _fails(lambda: _sample(sc).result(timeout=LOST_S), cause)  # a new request fails too

        monkeypatch.setenv("COLUMNS", "250")
        assert cli.main(["status", "--base-url", ustack.base_url, "--api-key", ustack.api_key,
                         "--state-dir", str(ustack.state_dir)]) == 0
        out = capsys.readouterr().out
        assert "failing" in out and "RegistryError" in out

        _step(tc, 0)  # the trainer, which started before the file broke, trains on
        assert sup.proc("trainer") is trainer
    finally:
        overlay.write_text(kept)

    wait_for(lambda: sup.snapshot()["processes"][[m.name for m in sup.managed].index("sampler")]["state"]
             == "running", "the sampler up again", timeout_s=LOST_S)
    assert _sample(sc).result(timeout=LOST_S).sequences[0].tokens
    row = processes(status_json(capsys, ustack))["sampler"]
    assert row["error"] is None and row["state"] == "running"
    state = json.loads((ustack.state_dir / "supervisor.json").read_text())
    assert {p["name"]: p["error"] for p in state["processes"]}["sampler"] is None
