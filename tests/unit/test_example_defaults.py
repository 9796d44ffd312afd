"""examples/rl_loop.py ``default_base_url`` / ``default_api_key``: how the examples (rl_loop,
sweep, autoresearch) find an ``openrl serve`` without flags: $TINKER_BASE_URL, else the gateway
of the state dir $OPENRL_HOME (``ports.json``, as ``openrl serve`` writes it), else :8000."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import rl_loop  # noqa: E402


def test_base_url_env_then_ports_json_then_8000(monkeypatch, tmp_path):
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    monkeypatch.setenv("OPENRL_HOME", str(tmp_path))
    assert rl_loop.default_base_url() == "http://127.0.0.1:8000"
    (tmp_path / "ports.json").write_text("{not json")
    assert rl_loop.default_base_url() == "http://127.0.0.1:8000"
    (tmp_path / "ports.json").write_text(json.dumps({"gateway": "http://127.0.0.1:18431", "metrics": {}}))
    assert rl_loop.default_base_url() == "http://127.0.0.1:18431"
    monkeypatch.setenv("TINKER_BASE_URL", "http://10.0.0.1:9000")
    assert rl_loop.default_base_url() == "http://10.0.0.1:9000"


def test_api_key_env_then_state_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.setenv("OPENRL_HOME", str(tmp_path))
    assert rl_loop.default_api_key() is None
    (tmp_path / "api_key").write_text("tml-abc\n")
    assert rl_loop.default_api_key() == "tml-abc"
    monkeypatch.setenv("TINKER_API_KEY", "tml-env")
    assert rl_loop.default_api_key() == "tml-env"
