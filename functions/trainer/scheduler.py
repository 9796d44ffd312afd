"""Per-run seq_id ordering and the packing of several runs into one pass.

Every training request waits in its run's queue until all lower seq_ids have run
(invariant 2). A single scheduler task then takes, for every run, the longest prefix of
ready forward / forward_backward requests, and runs the prefixes of all runs that share a
base model as ONE engine pass (the co-batching of issue 8). Other operations
(optim_step, save, load) run alone, in order.

A request whose predecessor has not arrived after ``gap_timeout_s`` seconds fails with
category "user" instead of blocking the run forever; a duplicate of an applied request
gets the cached result of the first.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from openrl import metrics
from openrl.errors import UserError

PACKABLE = ("forward", "forward_backward")


@dataclass
class Pending:
    """One request waiting for its turn."""

    model_id: str
    seq_id: int
    op: str
    payload: Any
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class RunQueue:
    """The ordering state of one training run."""

    next_seq: int = 1
    pending: dict[int, Pending] = field(default_factory=dict)
    done: "OrderedDict[int, Any]" = field(default_factory=OrderedDict)  # seq_id -> result (recent)


class Scheduler:
    """Orders requests per run and packs ready forward(_backward)s across runs.

    Args:
        run_packed: ``async (list[Pending]) -> list[result]`` runs one packed pass
            (all items share a base model); results align with the input.
        run_single: ``async (Pending) -> result`` runs any other operation.
        group_of: base-model key of a run (only runs of one base model are packed).
        gap_timeout_s: how long a request may wait for a missing predecessor (seconds).
        window_s: how long to wait for more runs' requests before a pass (seconds).
        on_pass: called after every pass with its requests and its duration (seconds), for
            usage accounting; the packed-runs histogram is observed here.
        max_ahead: a request of a known run whose seq_id is more than this many past the
            run's next expected seq_id fails at once (UserError on ``seq_id``) instead of
            being held: nothing the SDK sends gets that far ahead, and held requests cost memory.
        gap_error: ``(model_id, seq_id, missing_seq_id) -> exception | None``: the failure of a
            request whose predecessor never arrived; None (or no callable) gives the default
            UserError on ``seq_id`` (the trainer answers "server" when the gap is work lost
            in a trainer crash, see ``TrainerFunction._gap_error``).
    """

    def __init__(self, run_packed: Callable[[list[Pending]], Awaitable[list]], run_single: Callable[[Pending], Awaitable],
                 group_of: Callable[[str], str], *, gap_timeout_s: float = 300.0, window_s: float = 0.002,
                 keep_done: int = 64, max_ahead: int = 10_000,
                 on_pass: Callable[[list[Pending], float], None] | None = None,
                 gap_error: Callable[[str, int, int], BaseException | None] | None = None):
        self.run_packed, self.run_single, self.group_of = run_packed, run_single, group_of
        self.on_pass = on_pass
        self.gap_error = gap_error
        self.gap_timeout_s, self.window_s, self.keep_done = gap_timeout_s, window_s, keep_done
        self.max_ahead = max_ahead
        self.runs: dict[str, RunQueue] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.passes = 0  # packed passes run (for metrics/tests)
        self.packed_runs_last = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    def queue(self, model_id: str) -> RunQueue:
        return self.runs.setdefault(model_id, RunQueue())

    def reset(self, model_id: str, next_seq: int = 1) -> None:
        """(Re)start ordering of a run at ``next_seq`` (after create / restore)."""
        q = self.queue(model_id)
        q.next_seq = next_seq

    async def submit(self, model_id: str, seq_id: int, op: str, payload: Any) -> Any:
        """Wait for the run's turn, run the request, return its result.

        Raises:
            UserError: the seq_id's predecessor never arrived (gap timeout), the seq_id
                is more than ``max_ahead`` past the run's next one, or the same seq_id is
                already waiting with different content.
        """
        known = self.runs.get(model_id)
        if known is not None and seq_id > known.next_seq + self.max_ahead:
            raise UserError("seq_id", f"seq_id {seq_id} is more than {self.max_ahead} ahead of the next expected "
                            f"seq_id {known.next_seq} of {model_id}")
        q = self.queue(model_id)
        if seq_id < q.next_seq:
            if seq_id in q.done:
                return q.done[seq_id]
            raise UserError("seq_id", f"seq_id {seq_id} of {model_id} was already applied")
        if seq_id in q.pending:
            return await asyncio.shield(q.pending[seq_id].future)
        fut = asyncio.get_running_loop().create_future()
        q.pending[seq_id] = Pending(model_id, seq_id, op, payload, fut)
        self._wake.set()
        return await fut

    def _ready(self) -> tuple[dict[str, list[list[Pending]]], list[Pending]]:
        packs: dict[str, list[list[Pending]]] = {}
        singles: list[Pending] = []
        now = time.monotonic()
        for mid, q in self.runs.items():
            if q.next_seq in q.pending:
                first = q.pending[q.next_seq]
                if first.op in PACKABLE:
                    run, s = [], q.next_seq
                    while s in q.pending and q.pending[s].op in PACKABLE:
                        run.append(q.pending[s])
                        s += 1
                    packs.setdefault(self.group_of(mid), []).append(run)
                else:
                    singles.append(first)
            else:
                for p in list(q.pending.values()):
                    if now - p.arrived > self.gap_timeout_s:
                        del q.pending[p.seq_id]
                        if not p.future.done():
                            exc = None
                            if self.gap_error is not None:
                                try:
                                    exc = self.gap_error(mid, p.seq_id, q.next_seq)
                                except Exception as e:  # noqa: BLE001 - never leave the request hanging
                                    exc = e
                            p.future.set_exception(exc or UserError(
                                "seq_id", f"seq_id {p.seq_id} waited {self.gap_timeout_s:.0f}s for seq_id "
                                f"{q.next_seq} of {mid}, which never arrived"))
        return packs, singles

    def _finish(self, p: Pending, result: Any = None, exc: BaseException | None = None) -> None:
        q = self.queue(p.model_id)
        q.pending.pop(p.seq_id, None)
        if p.seq_id == q.next_seq:
            q.next_seq += 1
        if exc is None:
            q.done[p.seq_id] = result
            while len(q.done) > self.keep_done:
                q.done.popitem(last=False)
        if not p.future.done():
            if exc is not None:
                p.future.set_exception(exc)
            else:
                p.future.set_result(result)

    def _account(self, items: list[Pending], seconds: float) -> None:
        """Report one pass (``seconds`` of wall time, one at a time on the device) to ``on_pass``."""
        if self.on_pass is not None:
            try:
                self.on_pass(items, seconds)
            except Exception:  # noqa: BLE001 - metrics never fail a request
                pass

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self.window_s:
                await asyncio.sleep(self.window_s)
            packs, singles = self._ready()
            for p in singles:
                t0 = time.perf_counter()
                try:
                    self._finish(p, await self.run_single(p))
                except Exception as exc:  # noqa: BLE001 - the failure belongs to this request
                    self._finish(p, exc=exc)
                self._account([p], time.perf_counter() - t0)
            for group in packs.values():
                items = [p for run in group for p in run]
                self.passes += 1
                self.packed_runs_last = len(group)
                metrics.PACKED_RUNS.observe(len(group))
                t0 = time.perf_counter()
                try:
                    results = await self.run_packed(items)
                except Exception as exc:  # noqa: BLE001
                    for p in items:
                        self._finish(p, exc=exc)
                    continue
                finally:
                    self._account(items, time.perf_counter() - t0)
                for p, r in zip(items, results):
                    if isinstance(r, BaseException):
                        self._finish(p, exc=r)
                    else:
                        self._finish(p, r)
            if packs or singles:
                self._wake.set()
