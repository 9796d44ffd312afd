"""Per-run seq_id ordering and the packing of several runs into one pass.

Every training request waits in its run's queue until all lower seq_ids have run
(invariant 2; the runs' cursors are a :class:`~functions.trainer.cursor.RunCursor`). The
scheduler plans; the trainer's one loop (:func:`run_works`) executes: :meth:`Scheduler.next_work`
hands out, for every run, the longest prefix of ready forward / forward_backward requests,
the prefixes of all runs that share a base model as ONE engine pass (a "pass" :class:`Work`,
the co-batching of issue 8); the ready ``optim_step``s of several runs on one base model as
one fused multi-tensor AdamW update ("optims"); other operations (save, load) of different
runs as "singles", which the trainer runs concurrently (one per run at a time, in seq_id
order within the run). :meth:`Scheduler.finish` resolves a work's requests.

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
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from functions.trainer.cursor import RunCursor
from openrl.errors import UserError
from openrl.observe import metrics

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
    dispatched: bool = False  # handed out by next_work, not finished yet


def request_tokens(payload: Any) -> int:
    """Tokens of a forward(_backward) payload: the sum of its datums' ``len(tokens)``; 0 for a
    payload without ``data`` (other ops, tests' stand-ins)."""
    try:
        return sum(len(d.tokens) for d in (getattr(payload, "data", None) or ()))
    except (TypeError, AttributeError):
        return 0


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


class RunDirectory(Protocol):
    """What the scheduler asks of the trainer's run table
    (:class:`functions.trainer.runs.RunTable` has both)."""

    def group_of(self, model_id: str) -> str:
        """The packing group of a run: only runs of one group (one base model) share a pass."""

    def owner(self, model_id: str) -> str | None:
        """The owner id (API key) of a run, for the fair fill; None: the run is its own owner."""


@dataclass
class Work:
    """One unit of work the scheduler hands out (:meth:`Scheduler.next_work`); the caller runs
    it and resolves it with :meth:`Scheduler.finish`.

    Attributes:
        kind: "pass" (the ready forward(_backward) prefixes of one base model's runs: one packed
            pass), "optims" (the ready ``optim_step``s of several runs of one base model: one
            fused update) or "singles" (the ready heads of different runs that are neither:
            saves, loads, single optim_steps; they may run concurrently, one per run).
        items: its requests, in order (a pass: run by run, each run's in seq_id order).
        group: the base model's packing group ("pass", "optims"); None for "singles".
        index: the pass number (1, 2, ...) for a "pass"; 0 otherwise.
    """

    kind: str
    items: list[Pending]
    group: str | None = None
    index: int = 0

    @property
    def runs(self) -> int:
        """Distinct runs in the work."""
        return len({p.model_id for p in self.items})


class Scheduler:
    """Orders requests per run and plans the trainer's work: packed passes across runs, fused
    optimizer batches, single requests. It runs nothing itself: the trainer's one loop takes
    :meth:`next_work`, executes it and calls :meth:`finish` (:func:`run_works`).

    Args:
        directory: the trainer's run table (:class:`RunDirectory`: packing group and owner of a
            run); the scheduler keeps no run table of its own beyond the requests it holds.
        cursor: the runs' seq_id cursors (:class:`functions.trainer.cursor.RunCursor`), shared
            with run durability; a new one when None.
        gap_timeout_s: how long a request may wait for a missing predecessor (seconds); then it
            fails with :meth:`RunCursor.gap_error` ("server" when the gap is work lost in a
            trainer crash, else "user" on ``seq_id``).
        window_s: how long to wait for more runs' requests before planning (seconds).
        max_ahead: a request of a known run whose seq_id is more than this many past the
            run's next expected seq_id fails at once (UserError on ``seq_id``) instead of
            being held: nothing the SDK sends gets that far ahead, and held requests cost memory.
        fused_optims: the ready ``optim_step``s of several runs of one base model go out as one
            "optims" work (one fused update); False: each is a single.
        policy: the batching policy (default: :class:`PackPolicy` with its defaults).
        pass_token_budget: most tokens per packed pass, filled round-robin over owners
            (:meth:`fill`); 0 = no budget (every ready request goes in).
        snapshots_beside: the ready ``save_weights_for_sampler`` heads go out as their own
            "snapshots" work, which :func:`run_works` runs beside the works after it
            (``Settings.pack_beside_pass``); False: they are singles.

    Attributes:
        passes: packed passes handed out. deferred: ready requests left for a later pass by the
        budget. pass_log: the last 256 passes, each a list of ``(model_id, seq_id, after_pass)``
        (tests and debugging; the same goes into the ``trainer pass`` span's ``openrl.pass.items``).
        optim_batches: fused optimizer batches handed out.
    """

    def __init__(self, directory: RunDirectory, *, cursor: RunCursor | None = None, gap_timeout_s: float = 300.0,
                 window_s: float = 0.002, max_ahead: int = 10_000, fused_optims: bool = True,
                 policy: PackPolicy | None = None, pass_token_budget: int = 0, snapshots_beside: bool = False):
        self.directory = directory
        self.snapshots_beside = bool(snapshots_beside)
        self.cursor = cursor if cursor is not None else RunCursor()
        self.pass_token_budget = int(pass_token_budget)
        self.deferred = 0
        self.pass_log: deque[list[tuple[str, int, int]]] = deque(maxlen=256)
        self.fused_optims = bool(fused_optims)
        self.policy = policy if policy is not None else PackPolicy()
        self._hold_until: float | None = None
        self.gap_timeout_s, self.window_s = gap_timeout_s, window_s
        self.max_ahead = max_ahead
        self._pending: dict[str, dict[int, Pending]] = {}  # model_id -> seq_id -> request
        self._wake = asyncio.Event()
        self._works: AsyncIterator[Work] | None = None
        self.passes = 0  # packed passes handed out (for metrics/tests)
        self.packed_runs_last = 0
        self.optim_batches = 0  # fused optim_step updates handed out

    def forget(self, model_id: str) -> None:
        """Drop a run's ordering state (unloaded)."""
        self._pending.pop(model_id, None)
        self.cursor.forget(model_id)
        self.policy.forget(model_id)

    def reset(self, model_id: str, next_seq: int = 1) -> None:
        """(Re)start ordering of a run at ``next_seq`` (after a create)."""
        self.cursor.reset(model_id, next_seq)

    async def submit(self, model_id: str, seq_id: int, op: str, payload: Any) -> Any:
        """Wait for the run's turn, let the trainer's loop run the request, return its result.

        Raises:
            UserError: the seq_id's predecessor never arrived (gap timeout), the seq_id
                is more than ``max_ahead`` past the run's next one, or was already applied.
            ServerError: the predecessor was lost with a trainer that died unflushed
                (:meth:`RunCursor.gap_error`).
        """
        cur = self.cursor
        if cur.known(model_id) and seq_id > cur.next_seq(model_id) + self.max_ahead:
            raise UserError("seq_id", f"seq_id {seq_id} is more than {self.max_ahead} ahead of the next expected "
                            f"seq_id {cur.next_seq(model_id)} of {model_id}")
        if not cur.known(model_id):
            cur.reset(model_id, 1)
        if seq_id < cur.next_seq(model_id):
            found, result = cur.result(model_id, seq_id)
            if found:
                return result
            raise UserError("seq_id", f"seq_id {seq_id} of {model_id} was already applied")
        q = self._pending.setdefault(model_id, {})
        if seq_id in q:
            return await asyncio.shield(q[seq_id].future)
        fut = asyncio.get_running_loop().create_future()
        q[seq_id] = Pending(model_id, seq_id, op, payload, fut,
                            tokens=request_tokens(payload) if op in PACKABLE else 0, after_pass=self.passes)
        if op in PACKABLE:
            group = self.directory.group_of(model_id)
            overlap = any(r for m, r in self._pending.items() if m != model_id and self.directory.group_of(m) == group)
            self.policy.arrived(model_id, group, time.monotonic(), overlap)
        elif op == "save_weights_for_sampler":  # the run goes off to sample: passes stop waiting for it
            self.policy.sampling(model_id)
        self._wake.set()
        return await fut

    def _ready(self) -> tuple[dict[str, list[list[Pending]]], list[Pending]]:
        """Per packing group, each run's ready prefix of forward(_backward)s; and the ready
        heads that are other ops. Requests handed out and not finished yet are not ready; a
        request that waited past the gap timeout for its predecessor fails here."""
        packs: dict[str, list[list[Pending]]] = {}
        singles: list[Pending] = []
        now = time.monotonic()
        for mid, q in self._pending.items():
            nxt = self.cursor.next_seq(mid)
            first = q.get(nxt)
            if first is not None:
                if first.dispatched:
                    continue
                if first.op in PACKABLE:
                    run, s = [], nxt
                    while s in q and q[s].op in PACKABLE and not q[s].dispatched:
                        run.append(q[s])
                        s += 1
                    packs.setdefault(self.directory.group_of(mid), []).append(run)
                else:
                    singles.append(first)
            else:
                for p in list(q.values()):
                    if now - p.arrived > self.gap_timeout_s:
                        del q[p.seq_id]
                        if not p.future.done():
                            p.future.set_exception(self.cursor.gap_error(mid, p.seq_id, self.gap_timeout_s))
        return packs, singles

    def _finish_one(self, p: Pending, result: Any = None, exc: BaseException | None = None) -> None:
        q = self._pending.get(p.model_id)
        if q is not None and q.get(p.seq_id) is p:
            del q[p.seq_id]
        self.cursor.finish(p.model_id, p.seq_id, result, ok=exc is None)
        if not p.future.done():
            if exc is not None:
                p.future.set_exception(exc)
            else:
                p.future.set_result(result)

    def finish(self, work: Work, results: list[Any] | BaseException) -> None:
        """Resolve ``work``: ``results`` aligns with ``work.items`` (a result, or the exception
        of that request), or is one exception for all. Each request's future gets its outcome
        and its run's cursor moves past it; the planner wakes up for what is ready now."""
        if isinstance(results, BaseException):
            results = [results] * len(work.items)
        if len(results) != len(work.items):
            results = [RuntimeError(f"{len(results)} results for {len(work.items)} requests")] * len(work.items)
        for p, r in zip(work.items, results):
            if isinstance(r, BaseException):
                self._finish_one(p, exc=r)
            else:
                self._finish_one(p, r)
        self._wake.set()

    def owner_key(self, model_id: str) -> str:
        """The owner a run's requests are filled and reported under: its owner id, else
        ``run:<model_id>`` (a run without one is its own owner)."""
        owner = self.directory.owner(model_id)
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
            owners.setdefault(self.owner_key(group[i][0].model_id), deque()).append(i)
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

    def _dispatch(self, kind: str, items: list[Pending], group: str | None = None, index: int = 0) -> Work:
        for p in items:
            p.dispatched = True
        return Work(kind, items, group, index)

    def _pass(self, gkey: str, chosen: list[list[Pending]]) -> Work:
        items = [p for run in chosen for p in run]
        self.passes += 1
        self.packed_runs_last = len(chosen)
        metrics.PACKED_RUNS.observe(len(chosen))
        self.pass_log.append([(p.model_id, p.seq_id, p.after_pass) for p in items])
        return self._dispatch("pass", items, gkey, self.passes)

    async def next_work(self) -> Work:
        """The next work to run, when there is some. The caller runs it and calls
        :meth:`finish` before asking again (:func:`run_works`); work is planned in rounds:
        the ready singles, then each base model's ready optim_steps, then (after those, so the
        runs they unblock join) each base model's packed pass, unless :class:`PackPolicy` holds
        it for runs that are due."""
        if self._works is None:
            self._works = self._plan()
        return await self._works.__anext__()

    async def _plan(self) -> AsyncIterator[Work]:
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
            optims: dict[str, list[Pending]] = {}
            others: list[Pending] = []
            for p in singles:
                if p.op == "optim_step" and self.fused_optims:
                    optims.setdefault(self.directory.group_of(p.model_id), []).append(p)
                else:
                    others.append(p)
            snaps = [p for p in others if p.op == "save_weights_for_sampler"] if self.snapshots_beside else []
            if snaps:  # sampler saves: run beside what follows (run_works)
                others = [p for p in others if p.op != "save_weights_for_sampler"]
                yield self._dispatch("snapshots", snaps)
            if others:  # one request per run at most (each run's head)
                yield self._dispatch("singles", others)
            for gkey, group in optims.items():
                self.optim_batches += 1
                yield self._dispatch("optims", group, gkey)
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
                yield self._pass(gkey, self.fill(group))
                ran = True
            if ran:
                self._wake.set()


async def run_works(scheduler: Scheduler, execute: Callable[[Work], Awaitable[list[Any]]]) -> None:
    """The trainer's loop: forever take :meth:`Scheduler.next_work`, run it with ``execute``
    (results aligned with ``work.items``, an exception per failed request), and resolve it
    with :meth:`Scheduler.finish`; an exception out of ``execute`` fails every request of
    that work. A "snapshots" work runs in a task of its own while the loop takes the next works
    (each run's later requests still wait for its save: they are not ready until it finishes).
    Cancel the task running it to stop (the snapshot tasks under way are cancelled with it)."""

    async def run(work: Work) -> None:
        try:
            results = await execute(work)
        except Exception as exc:  # noqa: BLE001 - the failure belongs to this work's requests
            results = exc
        scheduler.finish(work, results)

    beside: set[asyncio.Task] = set()
    try:
        while True:
            work = await scheduler.next_work()
            if work.kind == "snapshots":
                task = asyncio.get_running_loop().create_task(run(work))
                beside.add(task)
                task.add_done_callback(beside.discard)
                continue
            await run(work)
    finally:
        for task in list(beside):
            task.cancel()
