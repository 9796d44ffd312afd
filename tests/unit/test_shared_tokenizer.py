"""examples/rl_loop.py ``shared_tokenizer``: runs that start together load their base model's
tokenizer once (the H200 sweep lost 19 s to 8 concurrent loads; docs/benchmarks.md).

The training client here is a stand-in with only ``get_tokenizer`` (a counted, slow call): what
is tested is the single flight, not the SDK, whose real ``get_tokenizer`` runs in
tests/stack/test_autoresearch.py through the same helper."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import rl_loop  # noqa: E402


class _Client:
    def __init__(self, fail: int = 0):
        self.calls, self.fail, self.lock = 0, fail, threading.Lock()

    def get_tokenizer(self):
        with self.lock:
            self.calls += 1
            n = self.calls
        time.sleep(0.2)
        if n <= self.fail:
            raise OSError("tokenizer not found")
        return f"tok{n}"


@pytest.fixture(autouse=True)
def _fresh():
    rl_loop._tokenizers.clear()
    yield
    rl_loop._tokenizers.clear()


def test_eight_runs_at_once_load_one_tokenizer():
    c = _Client()

    async def go():
        return await asyncio.gather(*(rl_loop.shared_tokenizer(c, "m") for _ in range(8)))

    assert asyncio.run(go()) == ["tok1"] * 8 and c.calls == 1
    assert asyncio.run(rl_loop.shared_tokenizer(c, "m")) == "tok1" and c.calls == 1  # kept across loops
    assert asyncio.run(rl_loop.shared_tokenizer(c, "other")) == "tok2" and c.calls == 2  # per base model


def test_a_failed_load_is_raised_to_every_waiter_and_retried_next_time():
    c = _Client(fail=1)

    async def go():
        return await asyncio.gather(*(rl_loop.shared_tokenizer(c, "m") for _ in range(3)), return_exceptions=True)

    got = asyncio.run(go())
    assert all(isinstance(g, OSError) for g in got) and c.calls == 1
    assert asyncio.run(rl_loop.shared_tokenizer(c, "m")) == "tok2" and c.calls == 2
