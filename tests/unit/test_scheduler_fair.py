"""Fair sharing of one packed pass between API keys (issue 17 item 5): the scheduler's
per-pass token budget, filled round-robin over owners, then runs.

The executor is a recording stand-in for the trainer's (as in test_scheduler.py): these tests
check which requests go into which pass, never timings.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from functions.trainer.scheduler import PackPolicy, Pending, Scheduler, Work, request_tokens, run_works


def _payload(tokens: int):
    """A forward_backward payload stand-in of ``tokens`` tokens (one datum)."""
    return SimpleNamespace(data=[SimpleNamespace(tokens=[0] * tokens)])


def _pending(mid: str, seq: int, tokens: int, arrived: float) -> Pending:
    return Pending(mid, seq, "forward_backward", None, None, arrived=arrived, tokens=tokens)  # fill() never reads the future


class Owners:
    """A run directory: every run on one base model, owned as ``owners`` says."""

    def __init__(self, owners: dict[str, str]):
        self.owners = owners

    def group_of(self, model_id: str) -> str:
        return "base"

    def owner(self, model_id: str) -> str | None:
        return self.owners.get(model_id)


def _sched(owners: dict[str, str], budget: int) -> Scheduler:
    return Scheduler(Owners(owners), pass_token_budget=budget)  # fill() only: nothing runs


def _chosen(out):
    return [[(p.model_id, p.seq_id) for p in run] for run in out]


def test_request_tokens_sums_datums():
    assert request_tokens(SimpleNamespace(data=[SimpleNamespace(tokens=[1, 2, 3]), SimpleNamespace(tokens=[4])])) == 4
    assert request_tokens(None) == 0 and request_tokens({}) == 0


def test_flooding_key_fills_only_what_is_left_after_every_other_key():
    owners = {"a1": "A", "a2": "A", "b1": "B", "c1": "C"}
    s = _sched(owners, budget=1000)
    group = [
        [_pending("a1", k, 400, arrived=0.0 + k * 1e-3) for k in range(1, 11)],  # A's flood: 4000 tokens
        [_pending("a2", k, 400, arrived=0.5 + k * 1e-3) for k in range(1, 4)],
        [_pending("b1", 1, 50, arrived=1.0)],
        [_pending("c1", 1, 900, arrived=2.0), _pending("c1", 2, 10, arrived=2.1)],
    ]
    out = s.fill(group)
    # round 1: every owner's first request (A's oldest run, B, C: 400 + 50 + 900 > budget, all in);
    # then nothing else fits; a2 (A's other run) and the rest of a1 wait
    assert _chosen(out) == [[("a1", 1)], [("b1", 1)], [("c1", 1)]]
    assert s.deferred == 9 + 3 + 1


def test_round_robin_over_owners_then_runs_within_budget():
    owners = {"a1": "A", "a2": "A", "b1": "B"}
    s = _sched(owners, budget=1000)
    group = [
        [_pending("a1", k, 100, arrived=0.0) for k in range(1, 8)],
        [_pending("a2", k, 100, arrived=0.1) for k in range(1, 8)],
        [_pending("b1", k, 100, arrived=0.2) for k in range(1, 8)],
    ]
    out = s.fill(group)
    # 10 requests of 100 tokens: A and B alternate (5 each), A's alternate between a1 and a2
    assert _chosen(out) == [[("a1", 1), ("a1", 2), ("a1", 3)], [("a2", 1), ("a2", 2)],
                            [("b1", k) for k in range(1, 6)]]
    assert sum(p.tokens for run in out for p in run) == 1000


def test_a_run_that_does_not_fit_stops_but_smaller_ones_go_on():
    owners = {"a1": "A", "b1": "B", "b2": "B"}
    s = _sched(owners, budget=500)
    group = [
        [_pending("a1", 1, 100, 0.0), _pending("a1", 2, 450, 0.0), _pending("a1", 3, 10, 0.0)],
        [_pending("b1", 1, 100, 0.1), _pending("b1", 2, 100, 0.1)],
        [_pending("b2", 1, 100, 0.2)],
    ]
    out = s.fill(group)
    # a1's seq 2 does not fit (100+100+450): a1 stops there (its seq 3 cannot overtake it); B goes on
    assert _chosen(out) == [[("a1", 1)], [("b1", 1), ("b1", 2)], [("b2", 1)]]


def test_no_budget_takes_everything_and_unknown_owners_are_their_own():
    s = _sched({}, budget=0)
    group = [[_pending("x", 1, 10**6, 0.0), _pending("x", 2, 10**6, 0.0)], [_pending("y", 1, 5, 0.0)]]
    assert s.fill(group) is group
    s = _sched({}, budget=10)  # no owner known: each run counts as its own owner
    out = s.fill(group)
    assert _chosen(out) == [[("x", 1)], [("y", 1)]]


async def test_small_run_of_another_key_goes_into_the_next_pass_while_one_key_floods():
    """End to end through the scheduler loop: key A queues 40 big requests at once, key B a
    small one after A's first pass started; B's request runs in the pass right after its
    arrival, A's flood is spread over budget-sized passes, and every run stays in seq_id order
    with each request answered once."""
    passes: list[list[tuple[str, int, int]]] = []
    started = asyncio.Event()
    release = asyncio.Event()

    async def packed(items):
        passes.append([(p.model_id, p.seq_id, p.tokens) for p in items])
        started.set()
        await release.wait()
        return [f"fb{p.model_id}:{p.seq_id}" for p in items]

    async def execute(work: Work) -> list:
        return await packed(work.items) if work.kind == "pass" else ["single"] * len(work.items)

    owners = {"a": "key-A", "b": "key-B"}
    s = Scheduler(Owners(owners), window_s=0.001, pass_token_budget=4000, policy=PackPolicy(max_delay_s=0))
    loop = asyncio.get_running_loop().create_task(run_works(s, execute))
    try:
        flood = [asyncio.create_task(s.submit("a", k, "forward_backward", _payload(1000))) for k in range(1, 41)]
        await started.wait()  # A's first pass is running (and holds the device)
        first_pass = s.passes
        small = asyncio.create_task(s.submit("b", 1, "forward_backward", _payload(16)))
        await asyncio.sleep(0.01)
        release.set()
        assert await small == "fbb:1"
        results = await asyncio.gather(*flood)
        assert results == [f"fba:{k}" for k in range(1, 41)]
    finally:
        loop.cancel()
    b_pass = next(i for i, ps in enumerate(passes, 1) if any(m == "b" for m, _, _ in ps))
    assert b_pass == first_pass + 1, passes  # the next pass after B's arrival
    b_items = [p for ps in s.pass_log for p in ps if p[0] == "b"]
    assert b_items == [("b", 1, first_pass)]
    assert all(sum(t for _, _, t in ps) <= 4000 + 16 for ps in passes)  # budget (+ B's own first request)
    later_a = [seq for ps in passes[b_pass:] for m, seq, _ in ps if m == "a"]
    assert later_a, "A's flood must still have been queued behind B"
    a_order = [seq for ps in passes for m, seq, _ in ps if m == "a"]
    assert a_order == list(range(1, 41))  # seq_id order, each once
    assert s.deferred > 0
