"""The load-failure cache of the workers (openrl/model/loadfailures.py): a base model whose
directory does not load fails fast with its cause, and is tried again when its files change
or the cool-down passes. The clock is injected (no waiting); the directory and its files are real."""

from __future__ import annotations

import os

import pytest

from openrl.errors import first_line
from openrl.model.loadfailures import LoadFailures, ModelLoadError, describe_failures, dir_fingerprint


class Loader:
    """Counts the loads; raises ``exc`` while it is set."""

    def __init__(self, exc: Exception | None):
        self.exc, self.calls = exc, 0

    def __call__(self):
        self.calls += 1
        if self.exc is not None:
            raise self.exc
        return "engine"


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\x00" * 10)
    return d


def test_first_line_names_the_type_and_the_first_message_line():
    assert first_line(ValueError("\n  header too short\nmore detail")) == "ValueError: header too short"
    assert first_line(KeyError()) == "KeyError"


def test_a_failed_load_is_kept_and_fails_the_next_requests_without_loading(model_dir):
    now = [0.0]
    lf = LoadFailures(retry_s=60, clock=lambda: now[0])
    load = Loader(OSError("Error while deserializing header: incomplete metadata\ntrace"))
    with pytest.raises(ModelLoadError) as e:
        lf.load("Bad/Model", model_dir, load)
    msg = str(e.value)
    assert e.value.category == "server"
    assert f"base model 'Bad/Model' cannot be loaded from {model_dir}: OSError: Error while deserializing " \
           "header: incomplete metadata (" in msg and "trace" not in msg
    now[0] = 59.0
    for _ in range(3):
        with pytest.raises(ModelLoadError, match="incomplete metadata"):
            lf.load("Bad/Model", model_dir, load)
    assert load.calls == 1
    assert lf.failed() == {"Bad/Model": "OSError: Error while deserializing header: incomplete metadata"}
    assert describe_failures(lf) == "Bad/Model: OSError: Error while deserializing header: incomplete metadata"


def test_the_load_is_tried_again_after_the_cool_down(model_dir):
    now = [0.0]
    lf = LoadFailures(retry_s=60, clock=lambda: now[0])
    load = Loader(RuntimeError("out of memory"))
    with pytest.raises(ModelLoadError):
        lf.load("M", model_dir, load)
    now[0] = 60.0
    with pytest.raises(ModelLoadError):
        lf.load("M", model_dir, load)
    assert load.calls == 2
    load.exc = None
    now[0] = 121.0
    assert lf.load("M", model_dir, load) == "engine" and load.calls == 3
    assert lf.failed() == {} and describe_failures(lf) is None


def test_the_load_is_tried_again_when_the_directory_changes(model_dir):
    lf = LoadFailures(retry_s=3600, clock=lambda: 0.0)
    load = Loader(ValueError("truncated"))
    with pytest.raises(ModelLoadError):
        lf.load("M", model_dir, load)
    before = dir_fingerprint(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 20)  # the fixed file
    assert dir_fingerprint(model_dir) != before
    load.exc = None
    assert lf.load("M", model_dir, load) == "engine" and load.calls == 2


def test_a_zero_cool_down_tries_every_time_and_a_missing_directory_is_a_fingerprint(tmp_path):
    lf = LoadFailures(retry_s=0)
    load = Loader(FileNotFoundError("no config.json"))
    for _ in range(2):
        with pytest.raises(ModelLoadError, match="the next request tries again"):
            lf.load("M", tmp_path / "nowhere", load)
    assert load.calls == 2
    assert dir_fingerprint(tmp_path / "nowhere")[0] == "missing"
    with pytest.raises(ValueError, match="OPENRL_MODEL_RETRY_S"):
        LoadFailures(retry_s=-1)


def test_check_and_record_as_the_sampler_uses_them(model_dir):
    lf = LoadFailures(retry_s=60, clock=lambda: 0.0)
    lf.check("M", model_dir)  # nothing kept: load it
    err = lf.record("M", str(model_dir), ImportError("vllm engine core failed"))
    assert isinstance(err, ModelLoadError) and "ImportError: vllm engine core failed" in str(err)
    with pytest.raises(ModelLoadError):
        lf.check("Other/Name", model_dir)  # two names, one directory: one failure
    os.utime(model_dir / "model.safetensors", ns=(1, 1))  # touched: tried again
    lf.check("M", model_dir)
