"""openrl.config.Settings (env as source, explicit values win), the Function contract's probe
answers, and the trainer's RunTable."""

from __future__ import annotations

from pathlib import Path

import pytest

from functions.trainer.runs import RunTable
from openrl.config import DEFAULT_HOME, Settings
from openrl.contract.function import ALIVE, Function, probe


def test_settings_from_env_and_explicit_values_win(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENRL_HOME", str(tmp_path))
    monkeypatch.setenv("OPENRL_FLUSH_INTERVAL_S", "5")
    monkeypatch.setenv("OPENRL_PRELOAD", "a, b,,")
    monkeypatch.setenv("OPENRL_TRAINER_GPU_MEMORY", "")  # empty = unset
    monkeypatch.setenv("OPENRL_VLLM_GPU_UTIL", "0.3")  # the older name of OPENRL_SAMPLER_GPU_MEMORY
    monkeypatch.setenv("K_SINK", "http://broker")
    s = Settings()
    assert (s.flush_interval_s, s.preload, s.trainer_gpu_memory, s.sampler_gpu_memory, s.k_sink) == (
        5.0, ["a", "b"], None, 0.3, "http://broker")
    assert s.home_dir == tmp_path and s.storage_url == (tmp_path / "storage").as_uri()
    assert s.models_path == tmp_path / "models"
    over = Settings.of({"flush_interval_s": 0, "gap_timeout_s": 8, "registry": "/r.toml", "backend": "hf",
                        "gpu_memory": 0.5, "device": None, "unknown": 1})
    assert (over.flush_interval_s, over.seq_gap_timeout_s, over.model_registry, over.sampler_backend,
            over.trainer_gpu_memory, over.device) == (0.0, 8.0, "/r.toml", "hf", 0.5, None)
    assert Settings.of(over) is over and Settings.of(over, nats_url="nats://x:1").nats_url == "nats://x:1"


def test_settings_defaults_and_validation(monkeypatch):
    for var in ("OPENRL_HOME", "OPENRL_STORAGE", "OPENRL_SEQ_GAP_TIMEOUT_S", "OPENRL_FLUSH_INTERVAL_S"):
        monkeypatch.delenv(var, raising=False)
    s = Settings()
    assert s.home == DEFAULT_HOME and s.home_dir == Path(DEFAULT_HOME).expanduser()
    assert s.storage_url == (Path(DEFAULT_HOME).expanduser() / "storage").as_uri()  # gateway and workers alike
    assert (s.seq_gap_timeout_s, s.max_seq_ahead, s.pack_max_delay_s, s.restore_wait_s) == (300.0, 10_000, 0.25, 10.0)
    with pytest.raises(ValueError, match="flush_interval_s"):
        Settings(flush_interval_s=-1)
    monkeypatch.setenv("OPENRL_RESTORE_WAIT_S", "soon")
    with pytest.raises(ValueError, match="restore_wait_s"):
        Settings()


def test_probe_answers():
    assert probe((True, "Alive")) == ALIVE
    assert probe((False, "starting"), "ready") == (False, "starting")
    assert probe(True, "ready") == (True, "Ready") and probe(False, "alive") == (False, "not alive")


def test_functions_follow_the_contract():
    from functions.sampler import new as new_sampler
    from functions.trainer import new as new_trainer

    for fn in (new_trainer(), new_sampler()):
        assert isinstance(fn, Function)
        assert fn.alive() == ALIVE
        ok, reason = fn.ready()
        assert not ok and reason  # not started


def test_run_table():
    t = RunTable()
    assert "m" not in t and t.group_of("m") == "" and t.meta("m") == {}
    t.add("m", "/models/a", {"base_model": "A", "lora_config": {"rank": 4}, "optimizer_config": None})
    t.set_owner("m", "alice")
    assert "m" in t and list(t) == ["m"] and t.group_of("m") == "/models/a" and t.owner("m") == "alice"
    assert t.meta("m") == {"base_model": "A", "lora_config": {"rank": 4}, "optimizer_config": None}
    assert t.remove("m").base_key == "/models/a" and "m" not in t and t.owner("m") == "alice"


def test_gateway_settings_reach_the_signed_url_routes():
    """``app_from_env(cfg)``'s settings (:meth:`GatewaySettings.of`) carry the signed URLs'
    ``public_url``, ``download_ttl_s`` and ``download_secret``, which the download routes read
    from the app's Gateway (not from the environment); the secret stays out of the repr."""
    import asyncio
    from types import SimpleNamespace

    from functions.gateway.context import GatewaySettings
    from functions.gateway.routes_download import _public_base, _secret, url_ttl_s

    gs = GatewaySettings.of(Settings.of({"public_url": "http://pub:1/", "download_ttl_s": 7,
                                         "download_secret": "k3y", "proto_compress": True}))
    assert (gs.public_url, gs.download_ttl_s, gs.download_secret, gs.proto_compress) == ("http://pub:1/", 7, "k3y", True)
    assert "k3y" not in repr(gs)
    app = SimpleNamespace(state=SimpleNamespace(gw=SimpleNamespace(settings=gs)))
    request = SimpleNamespace(app=app, base_url="http://request:2/")
    assert (url_ttl_s(request), _public_base(request), asyncio.run(_secret(request))) == (7, "http://pub:1", b"k3y")
