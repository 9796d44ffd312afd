"""The trainer's scheduler and batching policy, on their own (no model, no NATS).

The scheduler plans and the trainer's loop (``run_works``) executes: ``Recorder.execute`` is
a recording stand-in for the trainer's executor (passes, fused optim batches, singles); these
tests check which requests the scheduler puts together and in which order, not the numerics
(those are in test_cobatch.py and test_optim_fused.py).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from functions.trainer.scheduler import PackPolicy, Scheduler, Work, run_works


class OneBase:
    """A run directory whose runs all share one base model and have no owner."""

    def group_of(self, model_id: str) -> str:
        return "base"

    def owner(self, model_id: str) -> None:
        return None


class Recorder:
    def __init__(self, pass_s: float = 0.0):
        self.passes: list[list[tuple[str, int]]] = []
        self.optims: list[list[str]] = []
        self.singles: list[tuple[str, int, str]] = []
        self.pass_s = pass_s

    async def execute(self, work: Work) -> list:
        if work.kind == "pass":
            return await self.packed(work.items)
        if work.kind == "optims":
            return await self.optims_(work.items)
        return list(await asyncio.gather(*(self.single(p) for p in work.items)))

    async def packed(self, items):
        self.passes.append([(p.model_id, p.seq_id) for p in items])
        if self.pass_s:
            await asyncio.sleep(self.pass_s)
        return [f"fb{p.model_id}:{p.seq_id}" for p in items]

    async def single(self, p):
        self.singles.append((p.model_id, p.seq_id, p.op))
        return f"{p.op}{p.model_id}:{p.seq_id}"

    async def optims_(self, items):
        self.optims.append([p.model_id for p in items])
        return [f"opt{p.model_id}:{p.seq_id}" for p in items]


class Running:
    """A scheduler with its loop (``run_works``) running on ``execute``; ``stop()`` cancels the
    loop; everything else is the scheduler's."""

    def __init__(self, scheduler: Scheduler, execute):
        self.scheduler = scheduler
        self.task = asyncio.get_running_loop().create_task(run_works(scheduler, execute))

    def __getattr__(self, name):
        return getattr(self.scheduler, name)

    async def stop(self) -> None:
        self.task.cancel()


def make(rec: Recorder, max_delay_s: float = 0.3, fused: bool = True) -> Running:
    s = Scheduler(OneBase(), window_s=0.001, fused_optims=fused, policy=PackPolicy(max_delay_s=max_delay_s))
    return Running(s, rec.execute)


async def _loop_of_steps(s: Scheduler, mid: str, steps: int, think_s: float, jitter_s: float):
    """One client: forward_backward then optim_step (pipelined, like the SDK), wait, repeat;
    between steps it "thinks" ``think_s`` plus a seeded random ``[0, jitter_s)`` seconds."""
    rng = random.Random(mid)
    seq = 1
    for k in range(steps):
        await asyncio.sleep(think_s + rng.uniform(0, jitter_s))
        fb = asyncio.create_task(s.submit(mid, seq, "forward_backward", None))
        opt = asyncio.create_task(s.submit(mid, seq + 1, "optim_step", {}))
        assert await fb == f"fb{mid}:{seq}"
        assert await opt == f"opt{mid}:{seq + 1}"
        seq += 2


async def test_concurrent_runs_share_passes_and_fused_optims():
    """4 clients whose requests arrive up to ~40 ms apart: once the policy has seen how late
    runs come (the first few passes), every pass holds all 4 runs, and their optim_steps
    apply as one fused update."""
    rec = Recorder(pass_s=0.01)
    s = make(rec)
    try:
        await asyncio.gather(*(_loop_of_steps(s, f"r{i}", 12, 0.005 * i, 0.04) for i in range(4)))
    finally:
        await s.stop()
    sizes = [len({m for m, _ in p}) for p in rec.passes]
    steady = sizes[3:-2]  # a run may start a step ahead of the others and end alone
    assert steady.count(4) >= 0.8 * len(steady), sizes
    assert max(len(o) for o in rec.optims) == 4 and sum(len(o) for o in rec.optims) == 48


async def test_seq_order_kept_within_packed_runs():
    """A run's requests run in seq_id order even when they arrive in reverse."""
    rec = Recorder()
    s = make(rec, max_delay_s=0.05)
    try:
        tasks = [asyncio.create_task(s.submit("a", q, "forward_backward", None)) for q in (3, 2, 1)]
        assert await asyncio.gather(*tasks) == ["fba:3", "fba:2", "fba:1"]
    finally:
        await s.stop()
    order = [q for p in rec.passes for _, q in p]
    assert order == sorted(order)


async def test_a_run_that_does_not_come_costs_one_bounded_delay():
    """Run b was active but stops sending: a's first pass waits at most max_delay_s for it,
    later passes do not wait at all."""
    rec = Recorder()
    s = make(rec, max_delay_s=0.2)
    try:
        await asyncio.gather(s.submit("a", 1, "forward_backward", None), s.submit("b", 1, "forward_backward", None))
        t0 = time.monotonic()
        await s.submit("a", 2, "forward_backward", None)
        first = time.monotonic() - t0
        t0 = time.monotonic()
        await s.submit("a", 3, "forward_backward", None)
        second = time.monotonic() - t0
    finally:
        await s.stop()
    assert 0.15 <= first < 1.0
    assert second < 0.15
    assert s.policy.activity["b"].missed


async def test_a_run_that_saved_for_sampling_is_not_waited_for():
    """After b's save_weights_for_sampler (its client samples next), a's passes are not held for
    b; b is waited for again once it trains beside a."""
    rec = Recorder()
    s = make(rec, max_delay_s=0.5)
    try:
        await asyncio.gather(s.submit("a", 1, "forward_backward", None), s.submit("b", 1, "forward_backward", None))
        assert not s.policy.activity["b"].missed
        await s.submit("b", 2, "save_weights_for_sampler", {})
        assert s.policy.activity["b"].missed
        held = s.policy.held
        await s.submit("a", 2, "forward_backward", None)
        assert s.policy.held == held, "a's pass was held for b, which is sampling"
        await asyncio.gather(s.submit("a", 3, "forward_backward", None), s.submit("b", 3, "forward_backward", None))
    finally:
        await s.stop()
    assert not s.policy.activity["b"].missed  # trained beside a: due again


async def test_runs_taking_turns_stop_being_waited_for():
    """One client alternating two runs (never overlapping) pays at most one delay per run."""
    rec = Recorder()
    s = make(rec, max_delay_s=0.1)
    try:
        t0 = time.monotonic()
        for k in range(1, 9):
            await s.submit("a", k, "forward_backward", None)
            await s.submit("b", k, "forward_backward", None)
        wall = time.monotonic() - t0
    finally:
        await s.stop()
    assert wall < 0.1 * 2 + 0.5, wall  # two holds at most, plus scheduling
    assert all(len(p) == 1 for p in rec.passes)


async def test_one_run_is_never_held():
    rec = Recorder()
    s = make(rec, max_delay_s=5.0)
    try:
        t0 = time.monotonic()
        for k in range(1, 6):
            await s.submit("solo", k, "forward_backward", None)
        assert time.monotonic() - t0 < 1.0
    finally:
        await s.stop()


async def test_max_delay_zero_turns_the_policy_off():
    rec = Recorder()
    s = make(rec, max_delay_s=0.0)
    try:
        await asyncio.gather(s.submit("a", 1, "forward_backward", None), s.submit("b", 1, "forward_backward", None))
        t0 = time.monotonic()
        await s.submit("a", 2, "forward_backward", None)
        assert time.monotonic() - t0 < 0.1
    finally:
        await s.stop()


async def test_optim_steps_without_fusion_run_one_by_one():
    rec = Recorder()
    s = make(rec, fused=False)
    try:
        await asyncio.gather(*(s.submit(m, 1, "optim_step", {}) for m in "abc"))
    finally:
        await s.stop()
    assert rec.optims == [] and sorted(m for m, _, _ in rec.singles) == ["a", "b", "c"]


async def test_failed_fused_optim_fails_only_its_run():
    """An optims work is answered per run: an exception for one run fails that future only."""
    rec = Recorder()

    async def optims(items):
        return [ValueError("bad") if p.model_id == "b" else "ok" for p in items]

    rec.optims_ = optims
    s = make(rec)
    try:
        res = await asyncio.gather(*(s.submit(m, 1, "optim_step", {}) for m in "abc"), return_exceptions=True)
    finally:
        await s.stop()
    assert res[0] == "ok" and res[2] == "ok" and isinstance(res[1], ValueError)
    assert s.cursor.next_seq("b") == 2  # the failed request still moved the run's cursor


def test_policy_delay_adapts_to_measured_lag():
    pol = PackPolicy(max_delay_s=0.5, lag_factor=1.5, min_delay_s=0.01)
    assert pol.delay("g") == 0.5  # nothing measured yet: the bound
    pol.arrived("a", "g", 0.0, overlap=False)
    pol.arrived("b", "g", 0.0, overlap=False)
    assert pol.hold("g", {"a"}, 1.0) == pytest.approx(1.5)  # wait for b
    pol.arrived("b", "g", 1.02, overlap=True)  # b came 20 ms later
    assert pol.hold("g", {"a", "b"}, 1.02) is None
    assert pol.delay("g") == pytest.approx(0.03)
    # c missed the next hold (30 ms) and came 100 ms after it began: the hold grows to catch it
    pol.arrived("c", "g", 1.05, overlap=True)
    assert pol.hold("g", {"a", "b"}, 2.0) == pytest.approx(2.03)
    assert pol.hold("g", {"a", "b"}, 2.04) is None and pol.activity["c"].missed
    pol.arrived("a", "g", 2.05, overlap=True)  # a's next request: c is still missed, nothing waits
    pol.arrived("c", "g", 2.14, overlap=True)
    assert pol.delay("g") == pytest.approx(1.5 * 0.14)


async def test_sampler_saves_run_beside_the_next_pass_and_keep_their_runs_order():
    """``snapshots_beside``: run a's save_weights_for_sampler goes out as a "snapshots" work that
    runs while run b's pass does (each waits for the other to start: one after the other would
    never finish), and run a's next forward_backward still waits for its save."""
    pass_started, save_started = asyncio.Event(), asyncio.Event()
    done: list[str] = []

    async def execute(work: Work) -> list:
        if work.kind == "snapshots":
            save_started.set()
            await asyncio.wait_for(pass_started.wait(), 30)
            done.append("save a")
            return [f"saved {p.model_id}" for p in work.items]
        assert work.kind == "pass"
        ids = [(p.model_id, p.seq_id) for p in work.items]
        if ("b", 1) in ids:
            pass_started.set()
            await asyncio.wait_for(save_started.wait(), 30)
        done.append(f"pass {ids}")
        return [f"fb{m}:{q}" for m, q in ids]

    s = Running(Scheduler(OneBase(), window_s=0.001, policy=PackPolicy(max_delay_s=0.0), snapshots_beside=True),
                execute)
    try:
        save = asyncio.create_task(s.submit("a", 1, "save_weights_for_sampler", None))
        after = asyncio.create_task(s.submit("a", 2, "forward_backward", None))
        fb = asyncio.create_task(s.submit("b", 1, "forward_backward", None))
        assert await asyncio.wait_for(asyncio.gather(save, fb, after), 60) == ["saved a", "fbb:1", "fba:2"]
    finally:
        await s.stop()
    assert done.index("save a") < done.index("pass [('a', 2)]")
