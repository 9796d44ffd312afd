"""Per-run seq_id ordering and the packing of several runs into one pass.

Every training request waits in its run's queue until all lower seq_ids have run
(invariant 2). A single scheduler task then takes, for every run, the longest prefix of
ready forward / forward_backward requests, and runs the prefixes of all runs that share a
base model as ONE engine pass (the co-batching of issue 8). The ready ``optim_step``s of
several runs on one base model apply as one fused multi-tensor AdamW update
(``run_optims``); other operations (save, load) of different runs run concurrently (one
per run at a time, in seq_id order within the run).

Batching policy (:class:`PackPolicy`): a pass does not start the moment one run is ready.
The scheduler knows which runs of the base model are *active* (they sent a forward or
forward_backward in the last ``active_s`` seconds) and holds the pass, up to a bounded
delay, for the active runs whose next request is due but has not arrived yet. This is the
"max queue delay" of dynamic batching (Triton's ``max_queue_delay_microseconds``, TF
Serving's ``batch_timeout_micros``), made adaptive: the delay is a few times the measured
lag between the first and the last run of a pass (an exponential moving average), never
more than ``max_delay_s``; a run that does not arrive within it stops counting as due until
it sends a request while other runs are at work, so a run that went away (or is busy
sampling, or takes turns with another run of the same client) costs one delay, not one per
pass. A run that asks for a sampler snapshot (``save_weights_for_sampler``, the first step of
an RL loop's sampling phase) stops counting as due at once, so the runs still training do not
wait for it while it samples (issue 25: runs out of lockstep). With one active run nothing is
ever held.

Fair sharing between tenants (:meth:`Scheduler.fill`): a pass takes at most
``pass_token_budget`` tokens (the datums' token counts), filled round-robin over *owners* (the
API key behind each run), and within an owner over its runs, one request at a time, each run
keeping a seq_id prefix. Every owner with a ready request gets its first request into the
pass whatever its size, so a key that floods the trainer with big batches fills the budget
only after every other key's next request is in: its surplus waits for later passes, and a
small run of another key runs in the very next pass. Owners are visited oldest waiting head
first (first come, first served across passes). A budget of 0 turns this off (every ready
request goes into the pass, as before).

A request whose predecessor has not arrived after ``gap_timeout_s`` seconds fails with
category "user" instead of blocking the run forever; a duplicate of an applied request
gets the cached result of the first.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from openrl.observe import metrics, tracing
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
    tokens: int = 0  # tokens of a forward(_backward) (sum over its datums), 0 for other ops
    after_pass: int = 0  # packed passes started before it arrived (its "next pass" is after_pass + 1)


def request_tokens(payload: Any) -> int:
    """Tokens of a forward(_backward) payload: the sum of its datums' ``len(tokens)``; 0 for a
    payload without ``data`` (other ops, tests' stand-ins)."""
    try:
        return sum(len(d.tokens) for d in (getattr(payload, "data", None) or ()))
    except (TypeError, AttributeError):
        return 0


@dataclass
class RunQueue:
    """The ordering state of one training run."""

    next_seq: int = 1
    pending: dict[int, Pending] = field(default_factory=dict)
    done: "OrderedDict[int, Any]" = field(default_factory=OrderedDict)  # seq_id -> result (recent)


@dataclass
class _RunActivity:
    """When a run last sent packable work, and whether it missed the last hold."""

    group: str
    last_packable: float
    missed: bool = False


class PackPolicy:
    """Decides whether a base model's pass waits for more runs (see the module doc).

    The hold lasts ``lag_factor`` x the largest of the last ``lag_window`` measured lags
    (seconds from a held pass's first ready run to a later run's arrival, counting a run that
    came just after the hold ended), within [``min_delay_s``, ``max_delay_s``]; with nothing
    measured yet, ``max_delay_s``.

    Args:
        max_delay_s: the longest a ready pass is held for missing runs (seconds).
        active_s: a run that sent no forward(_backward) for this long is not waited for (seconds).
        lag_factor: the hold is this many times the largest recent lag.
        min_delay_s: the shortest hold when some run is due (seconds).
        lag_window: how many recent lags are kept per base model.
    """

    def __init__(self, max_delay_s: float = 0.25, active_s: float = 30.0, lag_factor: float = 2.0,
                 min_delay_s: float = 0.01, lag_window: int = 32):
        self.max_delay_s, self.active_s = float(max_delay_s), float(active_s)
        self.lag_factor, self.min_delay_s = float(lag_factor), float(min_delay_s)
        self.activity: dict[str, _RunActivity] = {}
        self.lags: dict[str, deque[float]] = {}  # group -> recent lags (seconds)
        self.lag_window = int(lag_window)
        self.gather_since: dict[str, float] = {}  # group -> when its open hold began
        self.last_gather: dict[str, float] = {}  # group -> when its latest hold began (open or not)
        self.held = 0  # passes held at least once (metrics / tests)

    def _observe(self, group: str, lag: float) -> None:
        self.lags.setdefault(group, deque(maxlen=self.lag_window)).append(lag)

    def arrived(self, model_id: str, group: str, now: float, overlap: bool) -> None:
        """A packable request of ``model_id`` arrived; ``overlap``: another run of ``group`` had
        a request queued or running at that moment.

        A run that missed a hold is due again only once it arrives while others are at work
        (it runs alongside them); a run that takes turns with another (one client driving two
        runs one after the other) thus stops being waited for after one miss each.
        """
        a = self.activity.get(model_id)
        since = self.gather_since.get(group)
        if since is not None:  # joins a held pass: how late runs come
            self._observe(group, now - since)
        elif a is not None and a.missed and overlap and group in self.last_gather:
            lag = now - self.last_gather[group]  # came just after the hold it missed: hold longer
            if lag <= self.max_delay_s:
                self._observe(group, lag)
        if a is None:
            self.activity[model_id] = _RunActivity(group, now)
        else:
            a.group, a.last_packable = group, now
            if overlap:
                a.missed = False

    def sampling(self, model_id: str) -> None:
        """``model_id`` asked for a sampler snapshot (``save_weights_for_sampler``): its client
        samples next, for seconds, so no pass is held for it until its next packable request
        arrives while other runs are at work (as after a missed hold, without costing one)."""
        a = self.activity.get(model_id)
        if a is not None:
            a.missed = True

    def forget(self, model_id: str) -> None:
        self.activity.pop(model_id, None)

    def delay(self, group: str) -> float:
        """The current hold bound of ``group`` (seconds)."""
        lags = self.lags.get(group)
        if not lags:
            return self.max_delay_s
        return min(self.max_delay_s, max(self.min_delay_s, self.lag_factor * max(lags)))

    def due(self, group: str, ready: set[str], now: float) -> list[str]:
        """Active runs of ``group`` not in ``ready`` that a pass should wait for."""
        return [m for m, a in self.activity.items()
                if a.group == group and m not in ready and not a.missed and now - a.last_packable <= self.active_s]

    def hold(self, group: str, ready: set[str], now: float) -> float | None:
        """None: run ``group``'s pass now. Else the monotonic time until which to hold it."""
        if self.max_delay_s <= 0:
            return None
        due = self.due(group, ready, now)
        if not due:
            self.gather_since.pop(group, None)
            return None
        first = self.gather_since.get(group)
        if first is None:
            first = self.gather_since[group] = self.last_gather[group] = now
            self.held += 1
        deadline = first + self.delay(group)
        if now >= deadline:
            for m in due:  # did not come in time: not waited for until its next request
                self.activity[m].missed = True
            self.gather_since.pop(group, None)
            return None
        return deadline

    def ran(self, group: str) -> None:
        self.gather_since.pop(group, None)


class Scheduler:
    """Orders requests per run and packs ready forward(_backward)s across runs.

    Args:
        run_packed: ``async (list[Pending]) -> list[result]`` runs one packed pass
            (all items share a base model); results align with the input.
        run_single: ``async (Pending) -> result`` runs any other operation.
        group_of: ``(model_id) -> str``, the packing group of a run: only runs of one group
            (one base model) share a pass. The trainer passes its run table's
            :meth:`functions.trainer.runs.RunTable.group_of`; the scheduler keeps no run table
            of its own beyond the per-run ordering state in ``runs``.
        gap_timeout_s: how long a request may wait for a missing predecessor (seconds).
        window_s: how long to wait for more runs' requests before a pass (seconds).
        on_pass: called after every pass with its requests and its duration (seconds), for
            usage accounting; the packed-runs histogram is observed here.
        run_optims: ``async (list[Pending]) -> list[result | exception]`` applies the ready
            ``optim_step``s of several runs of one base model as one fused update (results
            align with the input); None runs each through ``run_single``.
        policy: the batching policy (default: :class:`PackPolicy` with its defaults).
        max_ahead: a request of a known run whose seq_id is more than this many past the
            run's next expected seq_id fails at once (UserError on ``seq_id``) instead of
            being held: nothing the SDK sends gets that far ahead, and held requests cost memory.
        gap_error: ``(model_id, seq_id, missing_seq_id) -> exception | None``: the failure of a
            request whose predecessor never arrived; None (or no callable) gives the default
            UserError on ``seq_id`` (the trainer answers "server" when the gap is work lost
            in a trainer crash, see ``TrainerFunction._gap_error``).
        owner_of: ``(model_id) -> str | None``, the owner id (API key) of a run, for the fair
            fill (:meth:`fill`); a run without one counts as its own owner. The trainer passes
            :meth:`functions.trainer.runs.RunTable.owner`.
        pass_token_budget: most tokens per packed pass, filled round-robin over owners
            (:meth:`fill`); 0 = no budget (every ready request goes in).

    Attributes:
        passes: packed passes started. deferred: ready requests left for a later pass by the
        budget. pass_log: the last 256 passes, each a list of ``(model_id, seq_id, after_pass)``
        (tests and debugging; the same goes into the ``trainer pass`` span's ``openrl.pass.items``).
    """

    def __init__(self, run_packed: Callable[[list[Pending]], Awaitable[list]], run_single: Callable[[Pending], Awaitable],
                 group_of: Callable[[str], str], *, gap_timeout_s: float = 300.0, window_s: float = 0.002,
                 keep_done: int = 64, max_ahead: int = 10_000,
                 on_pass: Callable[[list[Pending], float], None] | None = None,
                 gap_error: Callable[[str, int, int], BaseException | None] | None = None,
                 run_optims: Callable[[list[Pending]], Awaitable[list]] | None = None,
                 policy: PackPolicy | None = None,
                 owner_of: Callable[[str], str | None] | None = None, pass_token_budget: int = 0):
        self.owner_of = owner_of
        self.pass_token_budget = int(pass_token_budget)
        self.deferred = 0
        self.pass_log: deque[list[tuple[str, int, int]]] = deque(maxlen=256)
        self.run_packed, self.run_single, self.group_of = run_packed, run_single, group_of
        self.run_optims = run_optims
        self.policy = policy if policy is not None else PackPolicy()
        self._hold_until: float | None = None
        self.on_pass = on_pass
        self.gap_error = gap_error
        self.gap_timeout_s, self.window_s, self.keep_done = gap_timeout_s, window_s, keep_done
        self.max_ahead = max_ahead
        self.runs: dict[str, RunQueue] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.passes = 0  # packed passes run (for metrics/tests)
        self.packed_runs_last = 0
        self.optim_batches = 0  # fused optim_step updates run

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    def queue(self, model_id: str) -> RunQueue:
        return self.runs.setdefault(model_id, RunQueue())

    def forget(self, model_id: str) -> None:
        """Drop a run's ordering state (unloaded)."""
        self.runs.pop(model_id, None)
        self.policy.forget(model_id)

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
        q.pending[seq_id] = Pending(model_id, seq_id, op, payload, fut,
                                    tokens=request_tokens(payload) if op in PACKABLE else 0, after_pass=self.passes)
        if op in PACKABLE:
            group = self.group_of(model_id)
            overlap = any(r.pending for m, r in self.runs.items() if m != model_id and self.group_of(m) == group)
            self.policy.arrived(model_id, group, time.monotonic(), overlap)
        elif op == "save_weights_for_sampler":  # the run goes off to sample: passes stop waiting for it
            self.policy.sampling(model_id)
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

    async def _run_singles(self, singles: list[Pending]) -> None:
        """Run ready non-packable requests: the optim_steps of one base model together (when
        ``run_optims`` is set), the others one at a time."""
        optims: dict[str, list[Pending]] = {}
        others = []
        for p in singles:
            if p.op == "optim_step" and self.run_optims is not None:
                optims.setdefault(self.group_of(p.model_id), []).append(p)
            else:
                others.append(p)

        async def one(p: Pending) -> None:
            t0 = time.perf_counter()
            try:
                with metrics.busy_clock("trainer").job():  # openrl_busy_seconds_total
                    r = await self.run_single(p)
                self._finish(p, r)
            except Exception as exc:  # noqa: BLE001 - the failure belongs to this request
                self._finish(p, exc=exc)
            self._account([p], time.perf_counter() - t0)

        # one request per run at most (each run's head): different runs' saves / loads run at
        # once (their engine work is serialised by the caller's lock, their I/O overlaps)
        await asyncio.gather(*(one(p) for p in others))
        for group in optims.values():
            self.optim_batches += 1
            t0 = time.perf_counter()
            try:
                with metrics.busy_clock("trainer").job():
                    results = await self.run_optims(group)
            except Exception as exc:  # noqa: BLE001
                results = [exc] * len(group)
            self._account(group, time.perf_counter() - t0)
            for p, r in zip(group, results):
                self._finish(p, exc=r) if isinstance(r, BaseException) else self._finish(p, r)

    def _owner(self, model_id: str) -> str:
        owner = self.owner_of(model_id) if self.owner_of is not None else None
        return owner or f"run:{model_id}"

    def fill(self, group: list[list[Pending]]) -> list[list[Pending]]:
        """The part of one base model's ready work that goes into the next pass.

        ``group`` holds, per run, its ready prefix of forward(_backward)s in seq_id order. Owners
        (:meth:`_owner`) are visited in the order of their longest-waiting head request; each
        visit takes the next request of the owner's next run (its runs in turn). An owner's first
        request of the pass is always taken; a later one only while the pass stays within
        ``pass_token_budget`` tokens, else that run takes nothing more in this pass (its later
        seq_ids cannot overtake it) and the others go on. Returns the chosen prefixes, in the
        order of ``group``; what is left stays queued for the next pass (``deferred`` counts it).
        """
        budget = self.pass_token_budget
        if budget <= 0:
            return group
        order = sorted(range(len(group)), key=lambda i: group[i][0].arrived)
        owners: dict[str, deque[int]] = {}
        for i in order:
            owners.setdefault(self._owner(group[i][0].model_id), deque()).append(i)
        taken = [0] * len(group)
        used, served = 0, set()
        progressed = True
        while progressed:
            progressed = False
            for owner, runs in owners.items():
                if not runs:
                    continue
                i = runs[0]
                p = group[i][taken[i]]
                if owner in served and used + p.tokens > budget:
                    runs.popleft()  # this run is full for this pass; the owner's other runs go on
                    progressed = True
                    continue
                taken[i] += 1
                used += p.tokens
                served.add(owner)
                progressed = True
                runs.popleft()
                if taken[i] < len(group[i]):
                    runs.append(i)  # the owner's next request comes from its next run
        self.deferred += sum(len(run) - k for run, k in zip(group, taken))
        return [run[:k] for run, k in zip(group, taken) if k]

    async def _run_pass(self, group: list[list[Pending]]) -> None:
        items = [p for run in group for p in run]
        self.passes += 1
        self.packed_runs_last = len(group)
        metrics.PACKED_RUNS.observe(len(group))
        self.pass_log.append([(p.model_id, p.seq_id, p.after_pass) for p in items])
        t0 = time.perf_counter()
        try:
            with tracing.span("trainer pass", attributes={
                    "openrl.pass.index": self.passes, "openrl.pass.runs": len(group),
                    "openrl.pass.tokens": sum(p.tokens for p in items),
                    "openrl.pass.items": json.dumps([[p.model_id, p.seq_id, p.after_pass, p.tokens,
                                                      self._owner(p.model_id)] for p in items[:512]])}):
                with metrics.busy_clock("trainer").job():
                    results = await self.run_packed(items)
        except Exception as exc:  # noqa: BLE001
            for p in items:
                self._finish(p, exc=exc)
            return
        finally:
            self._account(items, time.perf_counter() - t0)
        for p, r in zip(items, results):
            if isinstance(r, BaseException):
                self._finish(p, exc=r)
            else:
                self._finish(p, r)

    async def _loop(self) -> None:
        while True:
            timeout = 1.0
            if self._hold_until is not None:
                timeout = max(0.0, min(timeout, self._hold_until - time.monotonic()))
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self.window_s:
                await asyncio.sleep(self.window_s)
            _, singles = self._ready()
            await self._run_singles(singles)
            packs, _ = self._ready()  # after the optim_steps: their runs' next passes may be ready
            self._hold_until = None
            ran = bool(singles)
            now = time.monotonic()
            for gkey, group in packs.items():
                until = self.policy.hold(gkey, {run[0].model_id for run in group}, now)
                if until is not None:
                    self._hold_until = until if self._hold_until is None else min(self._hold_until, until)
                    continue
                self.policy.ran(gkey)
                await self._run_pass(self.fill(group))
                ran = True
            if ran:
                self._wake.set()
