"""Usage per API key, kept where every gateway replica can read it: tokens trained, prefilled and
sampled, and accelerator seconds (trainer, sampler), per owner id (the key's id, never the key).

The workers account every request as they run it (:func:`openrl.observe.metrics.record_trained`,
:func:`openrl.observe.metrics.record_sampled` call :meth:`UsageLedger.add` of :data:`LEDGER`).
Their Prometheus counters (``openrl_usage_*_total``) are per process and restart at zero with
it, so each worker process also writes its running totals to the ``OPENRL_META`` KV bucket under
``usage.<owner>.<instance>`` (``instance``: a random id of the process): a background thread
flushes the owners whose totals changed every ``OPENRL_USAGE_FLUSH_S`` seconds (default 10; 0 =
off) and once more when the process exits normally (scale to zero, a drained stop). Each process
writes only its own keys, so there is no write contention; a reader sums an owner's keys
(:func:`owner_totals`). A process killed without exiting loses at most its last interval.
The flusher starts with the first accounted request of a process whose environment names a
NATS server (``OPENRL_NATS_URL``, as every deployed function's does), so unit tests and tools
that account nothing never connect.

Record (JSON): ``{owner, instance, function, tokens_trained, tokens_prefilled, tokens_sampled,
gpu_seconds: {trainer, sampler}, started, updated}``; seconds are the accelerator's (the CPU's
on a CPU stack), a packed trainer pass split among its owners by token share, concurrent
sampling jobs each counting their whole time (their decode passes overlap).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

log = logging.getLogger("openrl.observe.usage")

#: first key part of the usage records in ``OPENRL_META``
USAGE_PREFIX = "usage"
MEASURES = ("tokens_trained", "tokens_prefilled", "tokens_sampled")


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class OwnerUsage:
    """Running totals of one owner in one process (counts of tokens; seconds of the accelerator)."""

    tokens_trained: int = 0
    tokens_prefilled: int = 0
    tokens_sampled: int = 0
    gpu_seconds: dict[str, float] = field(default_factory=dict)

    def record(self, owner: str, instance: str, function: str, started: str) -> dict:
        """This owner's totals as the KV record (see the module doc)."""
        return {"owner": owner, "instance": instance, "function": function, "tokens_trained": self.tokens_trained,
                "tokens_prefilled": self.tokens_prefilled, "tokens_sampled": self.tokens_sampled,
                "gpu_seconds": dict(self.gpu_seconds), "started": started, "updated": _now_iso()}


class UsageLedger:
    """One process's usage totals per owner, and the thread that writes them to the KV bucket."""

    def __init__(self) -> None:
        self.instance = uuid.uuid4().hex[:16]
        self.started = _now_iso()
        self.function = ""
        self._lock = threading.Lock()
        self._owners: dict[str, OwnerUsage] = {}
        self._dirty: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def add(self, owner: str, *, function: str, tokens_trained: int = 0, tokens_prefilled: int = 0,
            tokens_sampled: int = 0, seconds: float = 0.0) -> None:
        """Account work of ``owner`` done by ``function`` (``trainer`` / ``sampler``): token counts
        and accelerator ``seconds``; starts the flusher on first use (see the module doc)."""
        with self._lock:
            u = self._owners.setdefault(owner, OwnerUsage())
            u.tokens_trained += int(tokens_trained)
            u.tokens_prefilled += int(tokens_prefilled)
            u.tokens_sampled += int(tokens_sampled)
            if seconds > 0:
                u.gpu_seconds[function] = u.gpu_seconds.get(function, 0.0) + float(seconds)
            self._dirty.add(owner)
            self.function = self.function or function
        if self._thread is None:
            self._start()

    def take_dirty(self) -> dict[str, dict]:
        """The KV records of the owners changed since the last call (their cumulative totals)."""
        with self._lock:
            out = {o: self._owners[o].record(o, self.instance, self.function, self.started) for o in self._dirty}
            self._dirty.clear()
        return out

    def totals(self) -> dict[str, OwnerUsage]:
        """A copy of this process's totals per owner."""
        with self._lock:
            return {o: OwnerUsage(u.tokens_trained, u.tokens_prefilled, u.tokens_sampled, dict(u.gpu_seconds))
                    for o, u in self._owners.items()}

    # ----- the flusher ----------------------------------------------------------------
    def _start(self) -> None:
        from openrl.config import Settings

        with self._lock:
            if self._thread is not None:
                return
            interval = Settings().usage_flush_s
            if interval <= 0 or not os.environ.get("OPENRL_NATS_URL"):
                self._thread = threading.Thread()  # marks "decided": no flusher in this process
                return
            self._thread = threading.Thread(target=self._run, args=(Settings().nats_url, interval),
                                            name="openrl-usage-flush", daemon=True)
            self._thread.start()
        atexit.register(self.stop)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Flush once more and stop the flusher (registered with :mod:`atexit`)."""
        self._stop.set()
        t = self._thread
        if t is not None and t.is_alive():
            t.join(timeout_s)

    def _run(self, url: str, interval: float) -> None:
        asyncio.run(self._loop(url, interval))

    async def _loop(self, url: str, interval: float) -> None:
        from openrl.transport.bus import Bus

        bus = None
        warned = False
        while True:
            stopping = self._stop.is_set()
            try:
                if bus is None:
                    bus = await Bus(url).connect()
                pending = self.take_dirty()
                try:
                    for owner, rec in pending.items():
                        await bus.meta_put(rec, USAGE_PREFIX, owner, self.instance)
                except BaseException:
                    with self._lock:  # not written: try again next time
                        self._dirty.update(pending)
                    raise
            except Exception as exc:  # noqa: BLE001 - NATS away: keep the totals, retry
                if not warned:
                    log.warning("usage records not written to %s (will retry): %s", url, exc)
                    warned = True
                if bus is not None:
                    try:
                        await bus.close()
                    except Exception:  # noqa: BLE001
                        pass
                    bus = None
            if stopping:
                break
            # wait for the interval or stop() by polling, not in an executor thread: Python's exit joins
            # executor threads before atexit runs stop(), so an executor wait held every worker's exit
            # for up to the whole interval and then failed ("cannot schedule new futures after shutdown")
            deadline = time.monotonic() + interval
            while not self._stop.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(min(STOP_POLL_S, max(0.0, deadline - time.monotonic())))
        if bus is not None:
            await bus.close()


#: seconds between two looks at the stop flag while the flusher waits
STOP_POLL_S = 0.1

#: this process's ledger (the workers' accounting calls go here)
LEDGER = UsageLedger()


def _sum(records: list[dict]) -> dict:
    out = {m: 0 for m in MEASURES}
    out["gpu_seconds"] = {"trainer": 0.0, "sampler": 0.0}
    for r in records:
        for m in MEASURES:
            out[m] += int(r.get(m) or 0)
        for fn, s in (r.get("gpu_seconds") or {}).items():
            out["gpu_seconds"][fn] = out["gpu_seconds"].get(fn, 0.0) + float(s)
    return out


async def owner_totals(bus, owner: str | None = None) -> dict[str, dict]:
    """Usage per owner from the KV records of every worker process that ever ran their requests:
    ``{owner: {tokens_trained, tokens_prefilled, tokens_sampled, gpu_seconds: {trainer, sampler},
    processes}}``; only ``owner``'s when given."""
    recs = await bus.meta_list(USAGE_PREFIX)
    by: dict[str, list[dict]] = {}
    for r in recs:
        o = r.get("owner")
        if o and (owner is None or o == owner):
            by.setdefault(o, []).append(r)
    return {o: {**_sum(rs), "processes": len(rs)} for o, rs in by.items()}
