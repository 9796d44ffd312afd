"""``openrl serve --model NAME=DIR`` starts its workers before it builds the offline model
(openrl/transport/embedded.py ``Stack._start``): the workers preload NAME, which does not need
the build, so their start (imports, the model load; vLLM's engine on a GPU) runs while the CLI
imports torch and builds ``tiny-qwen3``; the gateway reports healthy only once the build is done.
Without ``--model`` (or when a preloaded name points at the directory being built) the build
comes first, as before.

Real nats-server, worker and gateway processes on CPU with the micro model; the only stand-in is
a recorder around ``ensure_built`` that notes which processes were running when it was called
(and then builds for real)."""

from __future__ import annotations

import httpx
import pytest

from openrl.model import modelbuild
from openrl.model.registry import overlay_path
from openrl.transport import embedded


@pytest.fixture
def build_calls(monkeypatch):
    calls: list[dict] = []
    real = embedded.ensure_built

    def recorder(registry, **kw):
        stack = recorder.stack
        calls.append({"running": sorted(n for n, p in zip(("nats", "trainer", "sampler", "gateway"), stack.procs)
                                        if p is not None and p.poll() is None)})
        return real(registry, **kw)

    monkeypatch.setattr(embedded, "ensure_built", recorder)
    return recorder, calls


def _stack(tmp_path, preload: list[str]):
    return embedded.Stack(state_dir=tmp_path / "state", port=0, preload=preload, supervise=True, idle_timeout=0)


@pytest.mark.parametrize("preload", [True, False], ids=["--model", "no --model"])
def test_workers_start_while_the_offline_model_is_built(tmp_path, micro_model_dir, build_calls, preload):
    recorder, calls = build_calls
    models = tmp_path / "state" / "models"  # the stack's registry overlay and the built model live here
    models.mkdir(parents=True)
    if preload:  # (the micro model has no tokenizer, which add_model's check wants: the entry by hand)
        overlay_path(models).write_text(f'[models."org/micro"]\npath = "{micro_model_dir}"\n')
    s = recorder.stack = _stack(tmp_path, ["org/micro"] if preload else [])
    try:
        s.start()
        assert modelbuild.is_built(models / "tiny-qwen3")  # built before start() returned
        assert httpx.get(f"{s.base_url}/api/v1/healthz", timeout=5).status_code == 200
    finally:
        s.stop()
    (call,) = calls
    if preload:
        assert {"trainer", "sampler", "gateway"} <= set(call["running"]), call
    else:
        assert call["running"] == [], call


def test_a_preloaded_name_on_the_built_directory_waits_for_the_build(tmp_path, build_calls):
    recorder, calls = build_calls
    models = tmp_path / "state" / "models"
    models.mkdir(parents=True)
    # a name whose directory is the one the build fills (written by hand: add_model would refuse the
    # directory before it is built)
    overlay_path(models).write_text(f'[models."org/alias"]\npath = "{models / "tiny-qwen3"}"\n')
    s = recorder.stack = _stack(tmp_path, ["org/alias"])
    try:
        s.start()
    finally:
        s.stop()
    assert calls == [{"running": []}]
