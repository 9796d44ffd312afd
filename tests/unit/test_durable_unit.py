"""The trainer's run-state durability on its own: ``RunDurability`` with a real engine on the
tiny model, a real run cursor and ``file://`` storage in a temp dir (no NATS, no worker, no
gateway). The end-to-end version (SIGTERM a trainer process, resume through the SDK) is
tests/stack/test_trainer_resume.py.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from functions.trainer.durable import RunDurability, decode_result, encode_result, lora_spec
from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
from functions.trainer.cursor import RunCursor
from functions.trainer.runs import RunTable
from openrl.model.registry import ModelRegistry
from openrl.storage import FileStorage, RunStateConflict

BASE = "Qwen/Qwen3-4B-Instruct-2507"


@pytest.fixture(scope="module")
def base_dir(models_dir):
    return ModelRegistry.load(None, models_dir=models_dir).resolve(BASE).path


class Trainer:
    """The pieces of a trainer that RunDurability is given (what TrainerFunction wires up)."""

    def __init__(self, base_dir, storage, interval_s: float = 0.0):
        self.base_dir = base_dir
        self.engines: dict[str, TrainerEngine] = {}
        self.runs = RunTable()
        self.lock = asyncio.Lock()

        self.cursor = RunCursor()  # the scheduler's (no request runs in these tests)
        self.durable = RunDurability(storage, self.runs, self.cursor, engines=self.engines,
                                     load_engine=self.load_engine, engine_lock=self.lock, interval_s=interval_s)

    def load_engine(self, name: str) -> str:
        assert name == BASE
        key = str(self.base_dir)
        if key not in self.engines:
            self.engines[key] = TrainerEngine(self.base_dir)
        return key

    def create(self, model_id: str, seed: int) -> TrainerEngine:
        key = self.load_engine(BASE)
        eng = self.engines[key]
        eng.create_run(model_id, lora_spec({"rank": 4, "seed": seed}))
        self.runs.add(model_id, key, {"base_model": BASE, "lora_config": {"rank": 4, "seed": seed}})
        self.cursor.reset(model_id, 1)
        return eng


def _step(eng: TrainerEngine, model_id: str) -> None:
    toks = list(range(300, 316))
    d = Datum(tokens=toks[:-1], loss_fn_inputs={"target_tokens": np.array(toks[1:]),
                                               "weights": np.ones(len(toks) - 1, dtype=np.float32)})
    (r,) = eng.forward_backward([FwdBwdItem(model_id, [d], "cross_entropy")])
    assert r.error is None
    eng.optim_step(model_id, {"learning_rate": 1e-2})


def _adapter(eng: TrainerEngine, model_id: str) -> dict[str, torch.Tensor]:
    return eng.state_dict(model_id)["adapter"]


def test_result_encoding_round_trips():
    for v in (None, b"\x00\x01proto", {"metrics": {"loss:sum": 1.5}}):
        assert decode_result(encode_result(v)) == v


def test_lora_spec_defaults():
    s = lora_spec(None)
    assert s.rank == 32 and s.train_attn and s.train_mlp and s.train_unembed
    assert lora_spec({"rank": 8, "train_mlp": False}).rank == 8


async def test_cursor_and_dirty_follow_the_scheduler(base_dir, tmp_path):
    t = Trainer(base_dir, FileStorage(tmp_path / "store"))
    t.create("run-a", seed=1)
    d = t.durable
    assert d.cursor("run-a") == 1 and d.dirty("run-a")  # never flushed
    assert await d.flush_run("run-a")
    assert not d.dirty("run-a") and await d.flush_all(final=False) == []  # nothing changed: no flush
    t.cursor.reset("run-a", 3)  # two requests applied
    assert d.dirty("run-a") and await d.flush_all(final=False) == ["run-a"]
    d.begin("run-a", 3)
    d.begin("run-a", 4)
    d.end("run-a", 3)
    assert d.in_flight == {"run-a": {4}}
    d.end("run-a", 4)
    assert d.in_flight == {}


async def test_flush_then_restore_in_another_trainer(base_dir, tmp_path):
    store = FileStorage(tmp_path / "store")
    a = Trainer(base_dir, store)
    eng = a.create("run-b", seed=2)
    _step(eng, "run-b")
    a.cursor.reset("run-b", 3, {2: {"metrics": {"x": 1.0}}})
    a.durable.begin("run-b", 2)  # answered but its handler not returned yet: its result is kept
    assert await a.durable.flush_run("run-b", final=True)
    before = _adapter(eng, "run-b")

    b = Trainer(base_dir, store)  # a new trainer process: nothing held
    assert "run-b" not in b.runs
    assert await b.durable.restore("run-b", 3)
    assert b.runs.meta("run-b")["base_model"] == BASE
    assert b.cursor.next_seq("run-b") == 3
    assert b.cursor.result("run-b", 2) == (True, {"metrics": {"x": 1.0}})
    after = _adapter(b.engines[str(base_dir)], "run-b")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert b.cursor.lost_at("run-b") is None  # a final flush: nothing can have been lost


async def test_restore_from_a_periodic_flush_marks_the_gap_as_lost(base_dir, tmp_path):
    """A restore from a periodic (not final) flush at cursor N: a request whose predecessor N
    never comes fails with category "server" (the dead trainer's unflushed work is gone); once
    the run moved past N, a gap is the client's again ("user")."""
    from openrl.errors import ServerError, UserError

    store = FileStorage(tmp_path / "store")
    a = Trainer(base_dir, store)
    a.create("run-p", seed=5)
    a.cursor.reset("run-p", 2)
    assert await a.durable.flush_run("run-p", final=False)
    b = Trainer(base_dir, store)
    assert await b.durable.restore("run-p", 2)
    assert b.cursor.lost_at("run-p") == 2
    err = b.cursor.gap_error("run-p", 4, 300)
    assert isinstance(err, ServerError) and "seq_id 2" in str(err)
    b.cursor.finish("run-p", 2, {})
    err = b.cursor.gap_error("run-p", 5, 300)
    assert isinstance(err, UserError) and err.field == "seq_id"


async def test_restore_of_an_unknown_run_is_false(base_dir, tmp_path):
    t = Trainer(base_dir, FileStorage(tmp_path / "store"))
    assert not await t.durable.restore("never-created", 1)
    assert not await t.durable.stored("never-created")


async def test_two_trainers_flushing_one_run_conflict(base_dir, tmp_path):
    """Compare-and-set on the pointer: a trainer whose token is stale cannot overwrite."""
    store = FileStorage(tmp_path / "store")
    a = Trainer(base_dir, store)
    a.create("run-c", seed=3)
    assert await a.durable.flush_run("run-c")
    b = Trainer(base_dir, store)
    assert await b.durable.restore("run-c", 1)
    b.cursor.reset("run-c", 2)
    assert await b.durable.flush_run("run-c")  # b moved the pointer
    a.cursor.reset("run-c", 2)
    with pytest.raises(RunStateConflict):
        await a.durable.flush_run("run-c")


async def test_forget_removes_stored_state(base_dir, tmp_path):
    t = Trainer(base_dir, FileStorage(tmp_path / "store"))
    t.create("run-d", seed=4)
    assert await t.durable.flush_run("run-d")
    assert await t.durable.stored("run-d")
    await t.durable.forget("run-d")
    assert not await t.durable.stored("run-d")
