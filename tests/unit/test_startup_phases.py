"""openrl.observe.startup: the process age from /proc and the per-phase record behind
``openrl_startup_seconds``."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from openrl.observe import startup


def test_process_age_is_this_process():
    t0 = time.monotonic()
    age = startup.process_age_s()
    assert age is not None and age > 0
    # pytest imported torch etc. before this test: the process is older than this test
    assert age >= time.monotonic() - t0
    assert age < 24 * 3600


def test_timed_records_exports_and_keeps_the_last_value():
    with startup.timed("unit_phase"):
        time.sleep(0.02)
    assert startup.phases()["unit_phase"] >= 0.02
    assert REGISTRY.get_sample_value("openrl_startup_seconds", {"phase": "unit_phase"}) >= 0.02
    startup.record("unit_phase", 1.5)
    assert REGISTRY.get_sample_value("openrl_startup_seconds", {"phase": "unit_phase"}) == 1.5
    assert not startup.first("unit_phase") and startup.first("never_recorded")


def test_a_failed_phase_is_still_timed():
    with pytest.raises(RuntimeError):
        with startup.timed("unit_failing"):
            raise RuntimeError("x")
    assert "unit_failing" in startup.phases()
