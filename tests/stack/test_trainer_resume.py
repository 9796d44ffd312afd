"""Trainer state survives scale-down (invariant 7), and checkpoints expire.

- Run-state storage (``_runstate/<run>/``): snapshot + compare-and-set pointer on both
  backends (``file://`` and ``gs://`` against the fake-gcs-server emulator), invisible to
  checkpoint listings, the TTL sweeper and tinker:// paths.
- The trainer Function in-process: stop() flushes (with gradients pending), a new
  Function restores on the run's first request, a redelivered request below the cursor
  is not applied twice, and the continued run equals an uninterrupted one byte for byte.
- The real stack through the unmodified SDK: SIGTERM the trainer process between steps
  (what Knative sends on scale-down), start a new one, continue; then the same with a
  SIGKILL after a periodic flush; logprobs and adapter weights equal an uninterrupted run.
- TTL: a checkpoint saved with ``ttl_seconds`` is deleted by the gateway's sweeper and
  leaves the REST listings; one without TTL stays.

Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import BASE_MODEL, _make_stack
from fixtures_gcs import file_or_gcs_storage, gcs_emulator  # noqa: F401  (session fixture)
from openrl.errors import UserError
from openrl.storage import (
    RUNSTATE_DIR,
    ChecksumMismatch,
    FileStorage,
    RunStateConflict,
    TinkerPath,
    build_manifest,
    sweep_expired,
)

LR = 1e-2
SEED = 7
RANK = 4
PERIODIC = "0.3"  # OPENRL_FLUSH_INTERVAL_S of a trainer that flushes periodically


# --------------------------------------------------------------------------------------
# storage: the run-state area on both backends
# --------------------------------------------------------------------------------------


@pytest.fixture(params=["file", "gcs"])
def store(request, tmp_path, monkeypatch):
    return file_or_gcs_storage(request.param, request, tmp_path, monkeypatch)


def _files(d: Path, **content: bytes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for k, v in content.items():
        (d / k.replace("_", ".", 1)).write_bytes(v)
    return d


def _names(store) -> list[str]:
    if isinstance(store, FileStorage):
        return sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file())
    return sorted(b.name.split("/", 1)[1] for b in store.client.list_blobs(store.bucket_name, prefix="ckpts/"))


def test_run_state_pointer_cas_and_snapshot_gc(store, tmp_path):
    run = "sess:train:0"
    assert store.get_run_state(run) is None
    t1 = store.put_run_state(run, _files(tmp_path / "a", adapter_bin=b"A1", optimizer_pt=b"O1"), {"cursor": 3}, None)
    rs = store.get_run_state(run)
    assert rs.token == t1 and rs.info["cursor"] == 3 and rs.info["run_id"] == run
    assert (rs.directory / "adapter.bin").read_bytes() == b"A1"
    assert store.get_run_state(run, download=False).directory is None

    # a writer that did not see t1 (a second trainer, or a stale create) cannot move the pointer
    with pytest.raises(RunStateConflict):
        store.put_run_state(run, _files(tmp_path / "b", adapter_bin=b"XX"), {"cursor": 9}, None)
    with pytest.raises(RunStateConflict):
        store.put_run_state(run, _files(tmp_path / "b2", adapter_bin=b"XX"), {"cursor": 9}, t1 + "0")
    assert store.get_run_state(run).info["cursor"] == 3
    before = _names(store)
    snap1 = rs.info["snapshot"]
    assert any(snap1 in n for n in before) and not any("XX" in n for n in before)

    t2 = store.put_run_state(run, _files(tmp_path / "c", adapter_bin=b"A2"), {"cursor": 5}, t1)
    rs2 = store.get_run_state(run)
    assert rs2.token == t2 != t1 and rs2.info["cursor"] == 5
    assert (rs2.directory / "adapter.bin").read_bytes() == b"A2"
    after = [n for n in _names(store) if not n.endswith(".lock")]
    assert not any(snap1 in n for n in after), after  # the old snapshot is deleted after the swap
    assert sorted(after) == sorted([f"{RUNSTATE_DIR}/{run}/HEAD.json",
                                    f"{RUNSTATE_DIR}/{run}/{rs2.info['snapshot']}/adapter.bin"])

    # run state is not a training run, a checkpoint or a tinker:// path
    assert store.list_runs() == []
    assert sweep_expired(store, now=time.time() + 10**9) == []
    with pytest.raises(UserError, match="reserved"):
        TinkerPath.parse(f"tinker://{RUNSTATE_DIR}/weights/x")

    store.delete_run_state(run)
    assert store.get_run_state(run) is None
    assert [n for n in _names(store) if not n.endswith(".lock")] == []
    store.delete_run_state(run)  # no-op


def test_run_state_corruption_is_detected(store, tmp_path):
    run = "sess:train:1"
    store.put_run_state(run, _files(tmp_path / "a", adapter_bin=b"good bytes"), {"cursor": 2}, None)
    rs = store.get_run_state(run, download=False)
    name = f"{RUNSTATE_DIR}/{run}/{rs.info['snapshot']}/adapter.bin"
    if isinstance(store, FileStorage):
        (store.root / name).write_bytes(b"evil bytes")
    else:
        store.bucket.blob(f"ckpts/{name}").upload_from_string(b"evil bytes")
    with pytest.raises(ChecksumMismatch):
        store.get_run_state(run)


def test_checkpoints_and_run_state_side_by_side(store, tmp_path):
    """Checkpoint listings and the TTL sweep see only checkpoints, never the run-state area."""
    p = TinkerPath.parse("tinker://r1/weights/old")
    src = _files(tmp_path / "ck", adapter_bin=b"W")
    store.put_dir(p, src, build_manifest(src, p, owner="o", ttl_seconds=1, extra={}))
    store.put_run_state("r1", _files(tmp_path / "rs", adapter_bin=b"S"), {"cursor": 4}, None)
    assert store.list_runs() == ["r1"]
    assert [m["tinker_path"] for m in store.list_run("r1")] == [str(p)]
    assert sweep_expired(store, now=time.time() + 5) == [str(p)]
    assert store.get_run_state("r1").info["cursor"] == 4


# --------------------------------------------------------------------------------------
# the trainer Function in-process
# --------------------------------------------------------------------------------------

MID = "inproc:train:0"
TOKS = list(range(100, 121))


def _fb_event(seq: int):
    from openrl.contract import events
    from openrl.edge import proto

    d = proto.FwdBwdDatum(tokens=TOKS[:-1], loss_fn_inputs={
        "target_tokens": np.array(TOKS[1:], dtype=np.int64), "weights": np.ones(len(TOKS) - 1, dtype=np.float32)})
    body = proto.encode_forward_backward_request(MID, seq, [d], "cross_entropy")
    return events.request_event("forward_backward", f"{MID}:{seq}", MID, body)


def _opt_event(seq: int):
    from openrl.contract import events

    return events.request_event("optim_step", f"{MID}:{seq}", MID,
                                {"model_id": MID, "seq_id": seq, "adam_params": {"learning_rate": LR}})


def _create_event():
    from openrl.contract import events

    return events.request_event("create_model", f"{MID}:0", MID, {
        "model_id": MID, "base_model": BASE_MODEL, "lora_config": {"rank": RANK, "seed": SEED},
        "optimizer_config": {"type": "adamw"}})


def _op(seq: int):
    return _fb_event(seq) if seq % 2 else _opt_event(seq)  # fb 1, optim 2, fb 3, ...


@pytest.mark.parametrize("backend", ["file", "gcs"])
def test_function_stop_flush_restore_redelivery(backend, request, models_dir, tmp_path, monkeypatch):
    """stop() after a forward_backward (gradients pending) flushes; a fresh Function restores
    on the next request, answers a redelivered seq_id below the cursor from the kept result
    when its handler had not returned at flush time and not at all otherwise (nothing is
    applied twice), and the continued run equals an uninterrupted run byte for byte."""
    from openrl.contract import events
    from functions.trainer.function import TrainerFunction

    monkeypatch.setenv("OPENRL_TORCH_THREADS", "1")
    if backend == "gcs":
        from openrl.storage.gcs import make_client

        monkeypatch.setenv("STORAGE_EMULATOR_HOST", request.getfixturevalue("gcs_emulator"))
        bucket = f"openrl-fn-{uuid.uuid4().hex[:10]}"
        make_client().create_bucket(bucket)
        ref_url, url = f"gs://{bucket}/ref", f"gs://{bucket}/s"
    else:
        ref_url, url = (tmp_path / "ref").as_uri(), (tmp_path / "s").as_uri()

    async def new_fn(url):
        fn = TrainerFunction()
        await fn.start({"storage": url, "models_dir": str(models_dir), "flush_interval_s": 0})
        return fn

    async def main():
        fn = await new_fn(ref_url)
        await fn.handle(_create_event())
        ref = [events.data_bytes(await fn.handle(_op(s))) for s in range(1, 8)]
        await fn.stop()

        fn = await new_fn(url)
        await fn.handle(_create_event())
        got = [events.data_bytes(await fn.handle(_op(s))) for s in range(1, 4)]  # ends on a forward_backward
        fn.durable.begin(MID, 3)  # as if seq 3's handler had not returned yet (result maybe not stored)
        await fn.stop()
        assert fn.durable.flushes == 1
        head = fn.storage.get_run_state(MID, download=False).info
        assert head["cursor"] == 4 and head["final"] is True
        assert {"grads.pt", "results.json", "optimizer.pt", "adapter_model.safetensors"} <= set(head["files"])

        fn2 = await new_fn(url)
        assert events.data_bytes(await fn2.handle(_op(3))) == got[2]  # redelivered: the kept result
        assert await fn2.handle(_op(2)) is None  # redelivered, result already stored: not applied again
        assert await fn2.handle(_create_event()) is not None  # redelivered create: restored, not reset
        got += [events.data_bytes(await fn2.handle(_op(s))) for s in range(4, 8)]
        await fn2.stop()
        assert got == ref

        # unload (on a trainer that does not hold the run) drops the stored state: the run is gone
        fn3 = await new_fn(url)
        await fn3.handle(events.request_event("unload_model", f"{MID}:unload", MID, {"model_id": MID, "seq_id": None}))
        assert fn3.storage.get_run_state(MID, download=False) is None
        with pytest.raises(UserError, match="not loaded"):
            await fn3.handle(_op(8))
        await fn3.stop()

    asyncio.run(main())


# --------------------------------------------------------------------------------------
# the real stack, through the SDK
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rstack(tmp_path_factory, models_dir):
    """A stack of its own (its trainer gets killed): periodic flushes off at first, a fast TTL sweeper."""
    s = _make_stack(tmp_path_factory, models_dir,
                    extra_env={"OPENRL_FLUSH_INTERVAL_S": "0", "OPENRL_SWEEP_INTERVAL_S": "0.5"})
    s.start()
    s.trainer_env = {}
    yield s
    s.stop()


@pytest.fixture(scope="module")
def svc(rstack):
    import tinker

    return tinker.ServiceClient(base_url=rstack.base_url,
                                api_key=(rstack.state_dir / "api_key").read_text().strip())


def _rest(stack):
    import tinker

    return tinker.RestClient(base_url=stack.base_url, api_key=(stack.state_dir / "api_key").read_text().strip())


def _trainer(stack) -> subprocess.Popen:
    return next(p for p in stack.procs if any("functions.trainer" in str(a) for a in p.args) and p.poll() is None)


def restart_trainer(stack, sig: int, **env) -> int:
    """Send ``sig`` to the trainer process, wait for it to exit, start a new one with the
    command and environment the embedded stack uses (plus ``env``). Returns the old exit code."""
    old = _trainer(stack)
    old.send_signal(sig)
    rc = old.wait(timeout=90)
    log = open(stack.state_dir / "logs" / "trainer.log", "ab")
    new = subprocess.Popen(old.args, env={**stack.env(), **env}, stdout=log, stderr=subprocess.STDOUT)
    stack.procs[stack.procs.index(old)] = new
    stack.trainer_env = env
    return rc


def _datum(i: int):
    from tinker import types

    toks = [(37 * i + 11 * k) % 5000 + 100 for k in range(24)]
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)})


def _step(tc, i: int) -> np.ndarray:
    from tinker import types

    fb = tc.forward_backward([_datum(i)], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    return np.asarray(fb.result().loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64)


def _weights(stack, tc, name: str) -> dict:
    from safetensors.numpy import load_file

    path = TinkerPath.parse(tc.save_weights_for_sampler(name).result().path)
    return load_file(str(stack.state_dir / "storage" / path.key / "adapter_model.safetensors"))


def _head(stack, run_id: str) -> dict | None:
    f = stack.state_dir / "storage" / RUNSTATE_DIR / run_id / "HEAD.json"
    return json.loads(f.read_text()) if f.exists() else None


def _run_id(tc) -> str:
    return tc.get_info().model_id


@pytest.fixture(scope="module")
def reference(svc, rstack):
    """An uninterrupted run: 6 steps; weights after 4 and after 6 steps."""
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=SEED).result()
    lps = []
    for i in range(4):
        lps.append(_step(tc, i))
    w4 = _weights(rstack, tc, "ref-4")
    for i in range(4, 6):
        lps.append(_step(tc, i))
    return {"lps": lps, "w4": w4, "w6": _weights(rstack, tc, "ref-6")}


def _assert_same(lps, ref_lps, w, ref_w):
    """A restored run's logprobs per step and adapter weights vs its uninterrupted twin's, within
    tests/tolerances.py's ``restore``; and it did train."""
    from tolerances import TOL, check_close

    assert len(lps) == len(ref_lps)
    for i, (a, b) in enumerate(zip(lps, ref_lps)):
        check_close("restore", a, b, TOL.restore, step=i)
    assert w.keys() == ref_w.keys()
    for k in w:
        check_close("restore", w[k], ref_w[k], TOL.restore, weight=k)
    assert any(np.abs(v).max() > 0 for k, v in w.items() if "lora_B" in k)  # it did train


def test_sigterm_between_steps_then_resume(rstack, svc, reference):
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=SEED).result()
    run = _run_id(tc)
    lps = [_step(tc, i) for i in range(3)]
    assert _head(rstack, run) is None  # periodic flushes are off: nothing stored yet
    old_pid = _trainer(rstack).pid

    # the new trainer also flushes periodically (used by the next test); it restores nothing before
    # our next request, so the pointer read below can only come from the old trainer's stop()
    assert restart_trainer(rstack, signal.SIGTERM, OPENRL_FLUSH_INTERVAL_S=PERIODIC) == 0
    head = _head(rstack, run)
    assert head is not None, "SIGTERM did not flush the run state"
    assert head["cursor"] == 7 and head["final"] is True and head["flushed_by"].endswith(f":{old_pid}")
    assert head["base_model"] == BASE_MODEL and head["lora_config"]["rank"] == RANK

    lps += [_step(tc, i) for i in range(3, 6)]  # the new trainer restores the run on its first request
    _assert_same(lps, reference["lps"], _weights(rstack, tc, "after-6"), reference["w6"])
    # the REST listing shows checkpoints only, never run state
    rest = _rest(rstack)
    listed = [c.tinker_path for c in rest.list_checkpoints(run).result().checkpoints]
    assert listed == [f"tinker://{run}/sampler_weights/after-6"]


def test_periodic_flush_survives_a_kill(rstack, svc, reference):
    """With periodic flushes on, a SIGKILLed trainer (no stop()) loses nothing that was flushed."""
    if rstack.trainer_env.get("OPENRL_FLUSH_INTERVAL_S") != PERIODIC:
        assert restart_trainer(rstack, signal.SIGTERM, OPENRL_FLUSH_INTERVAL_S=PERIODIC) == 0
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=SEED).result()
    run = _run_id(tc)
    lps = [_step(tc, i) for i in range(2)]
    deadline = time.monotonic() + 60
    while (_head(rstack, run) or {}).get("cursor") != 5:
        assert time.monotonic() < deadline, f"no periodic flush at cursor 5: {_head(rstack, run)}"
        time.sleep(0.1)
    assert _head(rstack, run)["final"] is False

    assert restart_trainer(rstack, signal.SIGKILL, OPENRL_FLUSH_INTERVAL_S=PERIODIC) == -signal.SIGKILL
    lps += [_step(tc, i) for i in range(2, 4)]
    _assert_same(lps, reference["lps"][:4], _weights(rstack, tc, "after-4"), reference["w4"])


def test_ttl_checkpoint_is_swept_and_unlisted(rstack, svc):
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=1).result()
    run = _run_id(tc)
    _step(tc, 0)
    short = tc.save_state("short", ttl_seconds=2).result().path
    keep = tc.save_state("keep").result().path
    rest = _rest(rstack)

    def listed() -> set[str]:
        return {c.tinker_path for c in rest.list_checkpoints(run).result().checkpoints}

    assert listed() == {short, keep}
    short_dir = rstack.state_dir / "storage" / TinkerPath.parse(short).key
    assert short_dir.is_dir()
    deadline = time.monotonic() + 30
    while short_dir.exists():
        assert time.monotonic() < deadline, "the sweeper did not delete the expired checkpoint"
        time.sleep(0.2)
    assert listed() == {keep}
    assert {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints} >= {keep}
    assert short not in {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    assert (rstack.state_dir / "storage" / TinkerPath.parse(keep).key / "manifest.json").is_file()
    assert (rstack.state_dir / "storage" / RUNSTATE_DIR).is_dir()  # the sweeper never touches run state


def test_restore_waits_for_the_previous_trainers_final_flush(models_dir, tmp_path, monkeypatch):
    """A new trainer asked for seq_id 4 while the stored pointer is a periodic one at cursor 3
    (the old trainer is still finishing, as in a rolling restart) waits for the old trainer's
    stop() flush instead of restoring stale state."""
    from openrl.contract import events
    from functions.trainer.function import TrainerFunction

    monkeypatch.setenv("OPENRL_TORCH_THREADS", "1")
    url = (tmp_path / "s").as_uri()

    async def main():
        old = TrainerFunction()
        await old.start({"storage": url, "models_dir": str(models_dir), "flush_interval_s": 0})
        await old.handle(_create_event())
        for s in (1, 2):
            await old.handle(_op(s))
        assert await old.durable.flush_all(final=False) == [MID]  # a periodic flush at cursor 3
        await old.handle(_op(3))  # applied, not yet flushed

        new = TrainerFunction()
        await new.start({"storage": url, "models_dir": str(models_dir), "flush_interval_s": 0, "restore_wait_s": 30})
        task = asyncio.create_task(new.handle(_op(4)))
        await asyncio.sleep(1.0)
        assert not task.done()  # waiting for a fresher pointer, not restoring cursor 3
        await old.stop()  # final flush at cursor 4
        result = await asyncio.wait_for(task, timeout=20)
        assert events.data_json(result)["metrics"]["grad_norm:mean"] > 0  # seq 3's gradients were there
        assert new.durable.flushed[MID] == 4 and new.scheduler.cursor.next_seq(MID) == 5
        await new.stop()

    asyncio.run(main())
