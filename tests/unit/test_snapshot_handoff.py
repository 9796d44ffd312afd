"""The shared-memory snapshot handoff (openrl/storage/handoff.py), the trainer's writer
(functions/trainer/snapshots.py) and the one-copy adapter file (openrl/model/lora/peft_io.py):
real files on a tmp dir and a real file:// storage; no GPU, so the device paths of
``openrl.model.lora.packed.write_packed`` (the pinned staging buffer, the mapped file) are checked
with CPU tensors where they can be (``_write_mapped``); the staged copy runs on the GPU only
(the GPU conformance run's handoff test)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from functions.trainer.snapshots import SnapshotWriter
from openrl.config import Settings
from openrl.model.lora.packed import HostStaging, _write_mapped, pack_adapter, write_packed
from openrl.model.lora.peft_io import write_adapter_direct
from openrl.storage import CheckpointExists, TinkerPath, open_storage
from openrl.storage.handoff import DURABLE_NAME, SnapshotHandoff


def _params(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"base_model.model.layers.{i}.q_proj.lora_{ab}.weight",
             torch.randn(*((4, 16) if ab == "A" else (24, 4)), generator=g)) for i in range(3) for ab in "AB"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_file_reads_back_as_the_same_tensors(tmp_path, dtype):
    params = [(k, v.to(dtype)) for k, v in _params()]
    n = write_adapter_direct(params, tmp_path / "a.safetensors")
    assert n == os.path.getsize(tmp_path / "a.safetensors")
    back = load_file(tmp_path / "a.safetensors")
    assert list(back) == sorted(k for k, _ in params) or set(back) == {k for k, _ in params}
    for k, v in params:
        assert back[k].dtype == dtype and torch.equal(back[k], v)
    with safe_open(tmp_path / "a.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_mapped_path_writes_the_same_bytes_as_the_written_one(tmp_path):
    """The unstaged device path (one copy into the memory-mapped file) and the CPU path agree."""
    packed = pack_adapter(_params(1))
    n = write_packed(packed, tmp_path / "cpu.safetensors")
    assert _write_mapped(packed, tmp_path / "mapped.safetensors") == n == packed.nbytes
    assert (tmp_path / "mapped.safetensors").read_bytes() == (tmp_path / "cpu.safetensors").read_bytes()


def test_packing_is_a_snapshot(tmp_path):
    """What pack_adapter took is written even if the tensors change before the write (the
    trainer releases the engine lock between the two)."""
    params = _params(2)
    want = {k: v.clone() for k, v in params}
    packed = pack_adapter(params)
    for _, v in params:
        v.add_(1.0)
    write_packed(packed, tmp_path / "a.safetensors")
    back = load_file(tmp_path / "a.safetensors")
    assert all(torch.equal(back[k], want[k]) for k in want)


def test_host_staging_reuses_a_buffer_that_fits():
    st = HostStaging()
    a = torch.empty(100, dtype=torch.uint8)  # stand-ins for pinned buffers (no CUDA here)
    st.give(a)
    assert st.take(80) is a and st._free == []
    st.give(a)
    st.give(torch.empty(10, dtype=torch.uint8))
    assert st.take(50) is a


def test_direct_writer_refuses_what_it_cannot_store(tmp_path):
    with pytest.raises(ValueError, match="no tensors"):
        write_adapter_direct([], tmp_path / "x")
    with pytest.raises(ValueError, match="cannot store dtype"):
        write_adapter_direct([("a", torch.zeros(2, dtype=torch.int64))], tmp_path / "x")


def _path(name: str = "s1-0") -> TinkerPath:
    return TinkerPath.parse(f"tinker://run-a/sampler_weights/{name}")


def _writer(tmp_path, max_bytes: int = 1 << 30, keep_s: float = 60.0):
    handoff = SnapshotHandoff(tmp_path / "shm", max_bytes=max_bytes, keep_s=keep_s)
    storage = open_storage((tmp_path / "storage").as_uri())
    return handoff, storage


def _fill(seed: int = 0):
    def write(d):
        write_adapter_direct(_params(seed), d / "adapter_model.safetensors")
        (d / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 32, "target_modules": ["q_proj"]}))
    return write


def _meta(path: TinkerPath, seq_id: int = 3) -> dict:
    return {"tinker_path": str(path), "training_run_id": path.run_id, "seq_id": seq_id, "owner": "o1",
            "ttl_seconds": None, "extra": {"base_model": "m"}}


def test_entry_appears_whole_then_persists_with_a_manifest(tmp_path):
    handoff, storage = _writer(tmp_path)
    p = _path()
    d = handoff.put(p, 10_000, _fill(), _meta(p))
    assert d == handoff.get(p) and not handoff.durable(p)
    assert [e[0] for e in handoff.pending()] == [p]
    assert not list(d.parent.glob(".tmp-*"))
    SnapshotWriter(handoff, storage, asyncio.Lock()).persist_now(p)
    assert handoff.durable(p) and handoff.pending() == []
    m = storage.manifest(p)
    assert m["owner"] == "o1" and m["seq_id"] == 3 and m["base_model"] == "m"
    assert set(m["files"]) == {"adapter_model.safetensors", "adapter_config.json"}  # no handoff markers
    stored = storage.get_dir(p)
    assert (stored / "adapter_model.safetensors").read_bytes() == (d / "adapter_model.safetensors").read_bytes()
    with pytest.raises(FileExistsError):
        handoff.put(p, 10, _fill(), _meta(p))


def test_persist_of_a_redelivery_accepts_its_own_checkpoint_only(tmp_path):
    handoff, storage = _writer(tmp_path)
    p = _path()
    handoff.put(p, 10_000, _fill(), _meta(p, seq_id=3))
    w = SnapshotWriter(handoff, storage, asyncio.Lock())
    w.persist_now(p)
    (handoff.dir_of(p) / DURABLE_NAME).unlink()
    w.persist_now(p)  # the same request's checkpoint is there: done
    assert handoff.durable(p)
    q = _path("s2-0")
    handoff.put(q, 10_000, _fill(), _meta(q, seq_id=5))
    storage.put_dir(q, handoff.dir_of(p), {**storage.manifest(p), "tinker_path": str(q), "seq_id": 9})
    with pytest.raises(CheckpointExists):
        w.persist_now(q)
    assert not handoff.durable(q)


def test_room_evicts_only_durable_entries_past_keep(tmp_path):
    handoff, storage = _writer(tmp_path, max_bytes=1 << 20, keep_s=0.0)
    w = SnapshotWriter(handoff, storage, asyncio.Lock())
    for i in range(2):
        p = _path(f"s{i}-0")
        assert handoff.put(p, 1000, _fill(i), _meta(p, i)) is not None
    size = handoff.size() // 2
    handoff.max_bytes = 2 * size + size // 2  # room for two entries and a half
    p2 = _path("s2-0")
    assert handoff.put(p2, size, _fill(2), _meta(p2, 2)) is None  # nothing durable: no room, storage path
    w.persist_now(_path("s0-0"))
    assert handoff.put(p2, size, _fill(2), _meta(p2, 2)) is not None  # the durable one made room
    assert handoff.get(_path("s0-0")) is None and handoff.get(_path("s1-0")) is not None


def test_recent_entries_are_kept_even_when_durable(tmp_path):
    handoff, storage = _writer(tmp_path, max_bytes=1500, keep_s=3600)
    p = _path()
    handoff.put(p, 1000, _fill(), _meta(p))
    SnapshotWriter(handoff, storage, asyncio.Lock()).persist_now(p)
    assert handoff.make_room(1000) is False and handoff.get(p) is not None


def test_a_pin_outlives_eviction_until_unpinned(tmp_path):
    handoff, storage = _writer(tmp_path, max_bytes=1 << 20, keep_s=0.0)
    p = _path()
    handoff.put(p, 1000, _fill(), _meta(p))
    pin = handoff.pin(p)
    assert pin is not None and handoff.pin(p) == pin
    SnapshotWriter(handoff, storage, asyncio.Lock()).persist_now(p)
    handoff.max_bytes = 1
    handoff.make_room(1)
    assert handoff.get(p) is None  # evicted ...
    assert load_file(pin / "adapter_model.safetensors")  # ... the pinned files still read
    assert handoff.entries() == [] and handoff.size() == 0  # pins are not entries
    handoff.unpin_except({str(p)})
    assert pin.exists()
    handoff.unpin_except(set())
    assert not pin.exists()


def test_concurrent_pins_of_one_snapshot_all_get_it(tmp_path):
    """Requests for a new snapshot arrive together (an RL step's prompts): every pin succeeds,
    whichever renames its links into place first (found on the H200: the losers got None and
    failed with 'no checkpoint' while the durable write was still under way)."""
    import threading

    handoff, _storage = _writer(tmp_path)
    p = _path()
    handoff.put(p, 1000, _fill(), _meta(p))
    for round_ in range(20):
        handoff.unpin_except(set())
        start = threading.Barrier(8)
        got: list = []

        def one():
            start.wait()
            got.append(handoff.pin(p))

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 8 and None not in got and len(set(got)) == 1, round_
    assert not list(handoff.root.glob(".pins/*/*/*/.tmp-*"))


def test_writer_save_falls_back_when_there_is_no_room(tmp_path):
    """SnapshotWriter.save with an engine stand-in (the trainer's export hook on CPU tensors)."""
    handoff, storage = _writer(tmp_path, max_bytes=10)

    class Engine:
        def adapter_nbytes(self, model_id):
            return 10_000

        def pack_sampler_snapshot(self, model_id):
            return pack_adapter(_params(0)), {"r": 4, "lora_alpha": 32, "target_modules": ["q_proj"]}

        write_packed_snapshot = staticmethod(_write_snapshot)

    async def go():
        w = SnapshotWriter(handoff, storage, asyncio.Lock())
        assert await w.save(Engine(), "run-a", _path(), seq_id=3, owner="o1", ttl_seconds=None, extra={}) is False
        handoff.max_bytes = 1 << 20
        assert await w.save(Engine(), "run-a", _path(), seq_id=3, owner="o1", ttl_seconds=None, extra={}) is True
        assert await w.save(Engine(), "run-a", _path(), seq_id=3, owner="o1", ttl_seconds=None, extra={}) is True
        with pytest.raises(CheckpointExists):
            await w.save(Engine(), "run-a", _path(), seq_id=4, owner="o1", ttl_seconds=None, extra={})
        await w.drain()
        assert handoff.durable(_path()) and storage.manifest(_path())["seq_id"] == 3

    asyncio.run(go())


def _write_snapshot(snapshot, d, *, staged=True):
    from functions.trainer.engine import TrainerEngine

    return TrainerEngine.write_packed_snapshot(snapshot, d, staged=staged)


@pytest.mark.parametrize("staged", [True, False])
def test_writer_holds_the_engine_lock_only_while_packing(tmp_path, staged):
    """staged (the default): the engine lock is held while the adapter is packed, not while the
    file is written, and at most ``writers`` (2) writes run at once; staged=False: the lock is
    held through the write. Lock-held and write intervals are recorded and compared."""
    import threading

    handoff, storage = _writer(tmp_path)
    held: list[list[float]] = []  # [acquired, released] of the engine lock
    writes: list[tuple[float, float]] = []
    pair = threading.Barrier(2)  # staged: the first two writes wait for each other
    count = iter(range(100))

    class Lock(asyncio.Lock):
        async def acquire(self):
            r = await super().acquire()
            held.append([time.monotonic(), float("inf")])
            return r

        def release(self):
            held[-1][1] = time.monotonic()
            super().release()

    lock = Lock()

    class Engine:
        def adapter_nbytes(self, model_id):
            return 1000

        def pack_sampler_snapshot(self, model_id):
            assert lock.locked()
            return pack_adapter(_params(0)), {"r": 4, "lora_alpha": 32, "target_modules": ["q_proj"]}

        @staticmethod
        def write_packed_snapshot(snapshot, d, *, staged=True):
            t0 = time.monotonic()
            if staged and next(count) < 2:
                pair.wait(timeout=30)  # fails the test (BrokenBarrierError) if writes cannot overlap
            time.sleep(0.3)  # a slow write (a hold of the lock to pack is milliseconds)
            n = _write_snapshot(snapshot, d, staged=staged)
            writes.append((t0, time.monotonic()))
            return n

    async def go():
        w = SnapshotWriter(handoff, storage, lock, staged=staged, writers=2)
        oks = await asyncio.gather(*[w.save(Engine(), "run-a", _path(f"s{i}-0"), seq_id=i, owner="o1",
                                            ttl_seconds=None, extra={}) for i in range(5)])
        assert oks == [True] * 5
        await w.drain()

    asyncio.run(go())
    assert len(held) == 5 and len(writes) == 5

    def inside_a_hold(a, b):
        return any(h0 <= a and b <= h1 for h0, h1 in held)

    # most writes under way at one moment (a sweep over the interval ends; a write that overlaps
    # two others that do not overlap each other is not three at once)
    events = sorted([(a, 1) for a, _ in writes] + [(b, -1) for _, b in writes], key=lambda e: (e[0], e[1]))
    most = cur = 0
    for _, d in events:
        cur += d
        most = max(most, cur)
    if staged:
        assert not any(inside_a_hold(a, b) for a, b in writes)
        assert most == 2
    else:
        assert all(inside_a_hold(a, b) for a, b in writes) and most == 1
    for i in range(5):
        assert load_file(handoff.dir_of(_path(f"s{i}-0")) / "adapter_model.safetensors")


def test_concurrent_puts_count_each_others_bytes(tmp_path):
    """Two writes under way at once cannot both pass the room check for one entry's room."""
    import threading

    handoff, _storage = _writer(tmp_path, max_bytes=1500)
    gate = threading.Barrier(2)
    got = []

    def slow_fill(d):
        gate.wait(timeout=5)  # both writes are under way before either finishes
        _fill()(d)

    def one(i):
        p = _path(f"s{i}-0")
        try:
            got.append(handoff.put(p, 1000, slow_fill, _meta(p, seq_id=i)))
        except threading.BrokenBarrierError:
            got.append("alone")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(map(str, got)).count("None") == 1, got  # the second found no room
    assert handoff._reserved == 0


def test_settings_turn_it_on_only_for_a_colocated_sampler(tmp_path):
    assert SnapshotHandoff.from_settings(Settings(home=str(tmp_path))) is None
    on = SnapshotHandoff.from_settings(Settings(home=str(tmp_path), colocated_sampler=True,
                                                handoff_dir=str(tmp_path / "h")))
    assert on is not None and on.root == tmp_path / "h" and on.max_bytes > 0
    assert SnapshotHandoff.from_settings(Settings(home=str(tmp_path), colocated_sampler=True,
                                                  handoff_dir="off")) is None
    start = time.time()
    assert on.pending() == [] and time.time() - start < 60


def test_sampler_pin_survives_an_unpin_already_under_way(tmp_path, monkeypatch):
    """SamplerFunction: an unpin that read what to keep before a new request for the same snapshot
    arrived must not remove the pin that request then loads (found in CI: 'holds no PEFT adapter'
    under the sweep example). A slow unpin makes the old interleaving certain."""
    from functions.sampler.function import SamplerFunction

    handoff, storage = _writer(tmp_path)
    p = _path()
    handoff.put(p, 1000, _fill(), _meta(p))
    handoff.pin(p)  # loaded earlier, since evicted from the engine
    slow_unpin = handoff.unpin_except

    def unpin_except(keep):
        time.sleep(0.3)
        slow_unpin(keep)

    monkeypatch.setattr(handoff, "unpin_except", unpin_except)
    fn = SamplerFunction()
    fn.handoff, fn.storage = handoff, storage

    async def go():
        unpin = asyncio.create_task(fn._unpin_unused())  # keep = {} : nothing loaded, nothing pinning
        await asyncio.sleep(0.05)
        fn._pinning[str(p)] = 1  # a request for the snapshot arrives (as handle() does)
        d = await fn._adapter_dir(p)
        await unpin
        return d

    d = asyncio.run(go())
    assert load_file(d / "adapter_model.safetensors")


def test_spare_files_are_made_taken_and_dropped_first(tmp_path):
    """SnapshotHandoff.make_spares / take_spare: pre-allocated files of one size, counted in
    size(), taken by rename (one each), and dropped before any entry when room is short."""
    from openrl.storage.handoff import SPARES_DIR

    handoff, _storage = _writer(tmp_path, max_bytes=10_000)
    assert handoff.make_spares(3000, 2) == 2 and handoff.make_spares(3000, 2) == 0  # already there
    assert handoff.size() == 6000
    assert handoff.make_spares(5000, 1) == 0  # 6000 + 5000 > max_bytes: not made
    dest = tmp_path / "taken.bin"
    assert handoff.take_spare(3000, dest) and dest.stat().st_size == 3000
    assert not handoff.take_spare(1234, tmp_path / "none.bin")  # no spare of that size
    assert handoff.size() == 3000
    p = _path()
    assert handoff.make_room(9000)  # only by dropping the last spare
    assert list((handoff.root / SPARES_DIR).iterdir()) == []
    handoff.put(p, 1000, _fill(), _meta(p))
    assert handoff.get(p) is not None


def test_writing_over_a_spare_gives_the_same_file(tmp_path):
    """write_packed into an existing (bigger, non-zero) file writes over it in place and cuts it
    to size: the same bytes as a new file, on the same inode."""
    packed = pack_adapter(_params(3))
    write_packed(packed, tmp_path / "new.safetensors")
    over = tmp_path / "over.safetensors"
    over.write_bytes(b"\xff" * (packed.nbytes + 4096))
    ino = over.stat().st_ino
    assert write_packed(packed, over) == packed.nbytes
    assert over.stat().st_ino == ino and over.read_bytes() == (tmp_path / "new.safetensors").read_bytes()


def test_writer_with_spares_writes_the_next_snapshot_over_a_spare(tmp_path):
    """SnapshotWriter(spares=1): after a save a spare of the weights file's size is made in the
    background; the next save's weights file is that spare (same inode), with the right tensors."""
    from openrl.storage.handoff import SPARES_DIR

    handoff, storage = _writer(tmp_path)
    lock = asyncio.Lock()

    class Engine:
        def adapter_nbytes(self, model_id):
            return 1000

        def pack_sampler_snapshot(self, model_id):
            return pack_adapter(_params(int(model_id))), {"r": 4, "lora_alpha": 32, "target_modules": ["q_proj"]}

        write_packed_snapshot = staticmethod(_write_snapshot)

    async def go():
        w = SnapshotWriter(handoff, storage, lock, spares=1)
        assert await w.save(Engine(), "0", _path("s0-0"), seq_id=0, owner="o1", ttl_seconds=None, extra={})
        await w.drain()
        (spare,) = list((handoff.root / SPARES_DIR).iterdir())
        ino = spare.stat().st_ino
        assert await w.save(Engine(), "1", _path("s1-0"), seq_id=1, owner="o1", ttl_seconds=None, extra={})
        f = handoff.dir_of(_path("s1-0")) / "adapter_model.safetensors"
        assert f.stat().st_ino == ino
        back = load_file(f)
        assert all(torch.equal(back[k], v) for k, v in _params(1))
        await w.drain()
        assert len(list((handoff.root / SPARES_DIR).iterdir())) == 1  # refilled

    asyncio.run(go())


def test_size_and_entries_skip_a_directory_that_vanishes_while_listed(tmp_path, monkeypatch):
    """A concurrent writer renames its ``.tmp-*`` directory into place while another save counts
    the handoff's bytes (``size()`` in ``make_room``): the vanished directory is skipped, not an
    error that fails the save (seen in CI with two writers, Python 3.11's ``Path.glob``). The race
    is made certain by removing the directory just before it is listed."""
    import os
    import shutil

    handoff, _storage = _writer(tmp_path)
    p = _path()
    handoff.put(p, 1000, _fill(), _meta(p))
    before = handoff.size()
    tmp = handoff.dir_of(p).parent / ".tmp-racing"
    tmp.mkdir()
    (tmp / "adapter_model.safetensors").write_bytes(b"x" * 10)
    real = os.scandir

    def scandir(d):
        if str(d).endswith(".tmp-racing"):
            shutil.rmtree(d)  # renamed into place by the other writer, just now
        return real(d)

    monkeypatch.setattr(os, "scandir", scandir)
    assert handoff.size() == before
    assert [e[0] for e in handoff.entries()] == [p]
