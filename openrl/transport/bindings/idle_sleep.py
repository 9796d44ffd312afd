"""Sleep while idle: a worker keeps its process but gives its accelerator memory back.

Between "running" and "scaled to zero" (the supervisor's SIGTERM after ``--idle-timeout``) a
worker can be **asleep**: after ``sleep_after_s`` seconds with no request in flight the binding
calls the Function's optional ``sleep()`` (the trainer moves its base weights, adapters and
optimizer state to host memory; the sampler's vLLM engine sleeps, level 1: weights to host,
KV cache dropped), and before the next request runs it awaits ``wake()``. A wake costs a
host-to-device copy of the weights instead of a new process, a model load and an engine
build (issue 32: back from idle in seconds).

States (:attr:`IdleSleep.state`, published in the worker's record and shown by ``openrl
status``): ``awake``, ``falling asleep``, ``asleep``, ``waking``. A Function without
``sleep`` / ``wake`` never sleeps. A ``sleep()`` that raises leaves the Function awake (the
cause is kept in :attr:`IdleSleep.error`, logged once, and the next try waits another
``sleep_after_s``); a ``sleep()`` that returns False declined (busy: e.g. a background flush),
and is asked again a second later. A ``wake()`` that raises fails the request that needed it
with that error (:class:`WakeFailed`, a server error naming the cause) and the next request
tries again; nothing is lost, since sleeping moved state and dropped none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Callable

from openrl.errors import ServerError, first_line

log = logging.getLogger("openrl.transport.sleep")

AWAKE, FALLING_ASLEEP, ASLEEP, WAKING = "awake", "falling asleep", "asleep", "waking"

#: Seconds between two checks of the idle clock (and before asking a busy Function again).
CHECK_S = 1.0


class WakeFailed(ServerError):
    """The Function could not wake for a request (the message names the cause)."""


def can_sleep(fn: Any) -> bool:
    """Whether ``fn`` offers the optional ``sleep()`` / ``wake()`` pair."""
    return callable(getattr(fn, "sleep", None)) and callable(getattr(fn, "wake", None))


class IdleSleep:
    """The sleep state of one Function in one worker process.

    Args:
        fn: the started Function (``async sleep() -> bool | None``, ``async wake()``).
        after_s: seconds with no request in flight before it sleeps (> 0).
        on_change: called with the new state after every change (e.g. to republish the
            worker's record); must not raise.
        check_s: seconds between checks of the idle clock.

    Raises:
        ValueError: ``after_s`` not > 0, or ``fn`` has no ``sleep`` / ``wake``.
    """

    def __init__(self, fn: Any, after_s: float, *, on_change: Callable[[str], None] | None = None,
                 check_s: float = CHECK_S):
        if not after_s > 0:
            raise ValueError(f"sleep_after (OPENRL_SLEEP_AFTER) must be > 0 seconds here, got {after_s}")
        if not can_sleep(fn):
            raise ValueError(f"{type(fn).__name__} has no sleep() / wake()")
        self.fn, self.after_s, self.check_s = fn, float(after_s), float(check_s)
        self.on_change = on_change
        self.state = AWAKE
        self.since = time.time()  # wall time of the last state change
        self.error: str | None = None  # the last sleep() / wake() failure, None once one succeeds
        self.sleeps = self.wakes = 0
        self.last_wake_s: float | None = None  # seconds the last wake() took
        self._in_flight = 0
        self._last_active = time.monotonic()
        self._lock = asyncio.Lock()  # one transition at a time
        self._task: asyncio.Task | None = None

    def _set(self, state: str) -> None:
        self.state, self.since = state, time.time()
        if self.on_change is not None:
            try:
                self.on_change(state)
            except Exception:  # noqa: BLE001 - reporting only
                log.warning("sleep state callback failed", exc_info=True)

    def describe(self) -> dict:
        """``{"state", "since_unix", "sleeps", "wakes", "last_wake_s", "error"}`` for the worker record."""
        return {"state": self.state, "since_unix": round(self.since, 3), "sleeps": self.sleeps,
                "wakes": self.wakes, "last_wake_s": self.last_wake_s, "error": self.error}

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """Hold the Function awake for one request: wakes it first if it sleeps.

        Raises:
            WakeFailed: ``wake()`` raised (the request is not run).
        """
        self._in_flight += 1
        try:
            if self.state != AWAKE:
                await self._wake()
            yield
        finally:
            self._in_flight -= 1
            self._last_active = time.monotonic()

    async def _wake(self) -> None:
        async with self._lock:
            if self.state == AWAKE:
                return
            self._set(WAKING)
            t0 = time.monotonic()
            try:
                await self.fn.wake()
            except Exception as exc:  # noqa: BLE001 - the request fails with the cause; stay asleep
                self.error = f"wake failed: {first_line(exc)}"
                log.error("%s", self.error, exc_info=True)
                self._set(ASLEEP)
                raise WakeFailed(f"the worker could not wake from sleep: {first_line(exc)}") from exc
            self.last_wake_s = round(time.monotonic() - t0, 3)
            self.wakes += 1
            self.error = None
            log.info("awake after %.3f s", self.last_wake_s)
            self._set(AWAKE)

    async def maybe_sleep(self) -> bool:
        """Sleep now if the Function has been idle ``after_s`` seconds; True if it fell asleep."""
        if self.state != AWAKE or self._in_flight or time.monotonic() - self._last_active < self.after_s:
            return False
        async with self._lock:
            if self.state != AWAKE or self._in_flight:
                return False
            self._set(FALLING_ASLEEP)
            try:
                done = await self.fn.sleep()
            except Exception as exc:  # noqa: BLE001 - stays awake; try again after another grace
                if self.error != f"sleep failed: {first_line(exc)}":
                    log.error("sleep failed (the worker stays awake): %s", first_line(exc), exc_info=True)
                self.error = f"sleep failed: {first_line(exc)}"
                self._last_active = time.monotonic()
                self._set(AWAKE)
                return False
            if done is False:  # declined (busy): ask again at the next check
                self._set(AWAKE)
                return False
            self.sleeps += 1
            self.error = None
            log.info("asleep after %.0f s idle", time.monotonic() - self._last_active)
            self._set(ASLEEP)
            return True

    async def run(self) -> None:
        """Check the idle clock every ``check_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.check_s)
            await self.maybe_sleep()

    def start(self) -> None:
        """Run :meth:`run` as a task of the running loop."""
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        """Stop checking (a sleeping Function stays asleep: its ``stop()`` handles host-resident state)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class Sleepy:
    """``fn`` with :meth:`handle` run inside ``sleeper.request()``: the binding hands this to
    its consumer instead of ``fn``, so a request wakes a sleeping Function first and a failed
    wake becomes that request's failed future (category ``"server"``). Every other attribute is
    ``fn``'s."""

    def __init__(self, fn: Any, sleeper: IdleSleep):
        self._fn, self.sleeper = fn, sleeper

    async def handle(self, event):
        async with self.sleeper.request():
            return await self._fn.handle(event)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)
