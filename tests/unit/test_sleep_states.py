"""openrl.transport.bindings.idle_sleep: the sleep states of a worker's Function.

The Function here is a stand-in that records calls (the real trainer and sampler sleep in
tests/stack/test_idle_sleep.py); the idle clock is driven by ``maybe_sleep()`` with a short
grace, never by wall-clock luck: every wait polls a condition with a generous deadline."""

from __future__ import annotations

import asyncio

import pytest

from openrl.transport.bindings.idle_sleep import (ASLEEP, AWAKE, IdleSleep, Sleepy, WakeFailed, can_sleep)


class Fn:
    def __init__(self):
        self.calls: list[str] = []
        self.sleep_answer: bool | Exception | None = None
        self.wake_error: Exception | None = None
        self.gate: asyncio.Event | None = None  # wake() waits on it when set

    async def sleep(self):
        self.calls.append("sleep")
        if isinstance(self.sleep_answer, Exception):
            raise self.sleep_answer
        return self.sleep_answer

    async def wake(self):
        self.calls.append("wake")
        if self.gate is not None:
            await self.gate.wait()
        if self.wake_error is not None:
            raise self.wake_error

    async def handle(self, event):
        self.calls.append(f"handle {event}")
        return event

    def describe(self):
        return {"device": "cpu"}


async def _idle(s: IdleSleep) -> None:
    s._last_active -= s.after_s  # the grace has passed (no wall-clock wait)


def test_only_functions_with_sleep_and_wake_can_sleep():
    assert can_sleep(Fn())
    assert not can_sleep(object())
    with pytest.raises(ValueError, match="sleep_after"):
        IdleSleep(Fn(), 0)
    with pytest.raises(ValueError, match="no sleep"):
        IdleSleep(object(), 1)


@pytest.mark.asyncio
async def test_sleeps_after_the_grace_and_a_request_wakes_it_first():
    fn, changes = Fn(), []
    s = IdleSleep(fn, 30, on_change=changes.append)
    assert not await s.maybe_sleep()  # the grace has not passed
    await _idle(s)
    assert await s.maybe_sleep() and s.state == ASLEEP and fn.calls == ["sleep"]
    wrapped = Sleepy(fn, s)
    assert await wrapped.handle("e1") == "e1"
    assert fn.calls == ["sleep", "wake", "handle e1"] and s.state == AWAKE
    assert changes == ["falling asleep", "asleep", "waking", "awake"]
    d = s.describe()
    assert d["sleeps"] == 1 and d["wakes"] == 1 and d["last_wake_s"] is not None and d["error"] is None
    assert wrapped.describe() == {"device": "cpu"}  # everything else is the Function's


@pytest.mark.asyncio
async def test_no_sleep_while_a_request_is_in_flight():
    fn = Fn()
    s = IdleSleep(fn, 30)
    async with s.request():
        await _idle(s)
        assert not await s.maybe_sleep()
    assert not await s.maybe_sleep()  # the request's end restarts the grace
    assert fn.calls == []


@pytest.mark.asyncio
async def test_a_declined_or_failed_sleep_leaves_it_awake():
    fn = Fn()
    s = IdleSleep(fn, 30)
    fn.sleep_answer = False
    await _idle(s)
    assert not await s.maybe_sleep() and s.state == AWAKE and s.error is None
    fn.sleep_answer = RuntimeError("engine busy\nmore")
    assert not await s.maybe_sleep() and s.state == AWAKE
    assert s.error == "sleep failed: RuntimeError: engine busy"
    assert not await s.maybe_sleep()  # a failure waits another grace before it tries again
    fn.sleep_answer = None
    await _idle(s)
    assert await s.maybe_sleep() and s.error is None


@pytest.mark.asyncio
async def test_concurrent_requests_wake_it_once():
    fn = Fn()
    s = IdleSleep(fn, 30)
    await _idle(s)
    await s.maybe_sleep()
    fn.gate = asyncio.Event()
    wrapped = Sleepy(fn, s)
    tasks = [asyncio.create_task(wrapped.handle(i)) for i in range(3)]
    for _ in range(100):
        if "wake" in fn.calls:
            break
        await asyncio.sleep(0.01)
    assert s.state == "waking" and not any(c.startswith("handle") for c in fn.calls)
    fn.gate.set()
    assert sorted(await asyncio.gather(*tasks)) == [0, 1, 2]
    assert fn.calls.count("wake") == 1 and s.state == AWAKE


@pytest.mark.asyncio
async def test_a_failed_wake_fails_the_request_and_the_next_one_tries_again():
    fn = Fn()
    s = IdleSleep(fn, 30)
    await _idle(s)
    await s.maybe_sleep()
    fn.wake_error = RuntimeError("CUDA out of memory")
    wrapped = Sleepy(fn, s)
    with pytest.raises(WakeFailed, match="could not wake from sleep: RuntimeError: CUDA out of memory") as ei:
        await wrapped.handle("e1")
    assert ei.value.category == "server"
    assert s.state == ASLEEP and s.error == "wake failed: RuntimeError: CUDA out of memory"
    fn.wake_error = None
    assert await wrapped.handle("e2") == "e2"
    assert s.state == AWAKE and s.error is None and fn.calls.count("wake") == 2


@pytest.mark.asyncio
async def test_the_background_check_puts_it_to_sleep():
    fn = Fn()
    s = IdleSleep(fn, 0.05, check_s=0.01)
    s.start()
    try:
        for _ in range(500):
            if s.state == ASLEEP:
                break
            await asyncio.sleep(0.01)
        assert s.state == ASLEEP
    finally:
        await s.stop()
