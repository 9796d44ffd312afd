"""``gs://`` weight storage against a real GCS emulator (fake-gcs-server on 127.0.0.1),
driven by the real ``google-cloud-storage`` client. Nothing is mocked; a few tests wrap
``GCSStorage._download_file`` / ``_upload_file`` to count calls or inject a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest

from fixtures_gcs import count_downloads, gcs_emulator  # noqa: F401  (session fixture; conftest may import it too)
from openrl.errors import NotFound, UserError
from openrl.storage import (
    ChecksumMismatch,
    CheckpointExists,
    FileStorage,
    TinkerPath,
    build_manifest,
    open_storage,
    sha256_file,
    sweep_expired,
)
from openrl.storage.gcs import GCSStorage, make_client

PREFIX = "ckpts/v1"


@pytest.fixture
def gcs(gcs_emulator, monkeypatch, tmp_path):  # noqa: F811
    """A fresh bucket on the emulator and a factory of ``GCSStorage`` replicas on it."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    client = make_client()
    bucket = f"openrl-{uuid.uuid4().hex[:12]}"
    client.create_bucket(bucket)
    n = iter(range(1000))

    def make(cache_dir: Path | None = None, prefix: str = PREFIX) -> GCSStorage:
        return GCSStorage(bucket, prefix, cache_dir=cache_dir or tmp_path / f"cache{next(n)}")

    make.client = client
    make.bucket = bucket
    return make


def write_ckpt(d: Path, files: dict[str, bytes]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    return d


def put(store, path: str, files: dict[str, bytes], tmp_path: Path, *, ttl: int | None = None, owner: str = "alice"):
    p = TinkerPath.parse(path)
    src = write_ckpt(tmp_path / f"src-{uuid.uuid4().hex[:8]}", files)
    return p, store.put_dir(p, src, build_manifest(src, p, owner=owner, ttl_seconds=ttl, extra={}))


def object_names(gcs, prefix: str = "") -> list[str]:
    return sorted(b.name for b in gcs.client.list_blobs(gcs.bucket, prefix=prefix))




FILES = {
    "adapter_model.safetensors": os.urandom(1 << 20),
    "adapter_config.json": b'{"r": 4}',
    "optimizer.pt": os.urandom(300_000),
}


def test_round_trip_layout_and_sha(gcs, tmp_path):
    store = gcs()
    path, m = put(store, "tinker://run-1/weights/step-0001", FILES, tmp_path)
    base = f"{PREFIX}/run-1/weights/step-0001/"
    assert object_names(gcs) == sorted([base + n for n in FILES] + [base + "manifest.json"])
    assert store.manifest(path) == m
    assert json.loads(gcs.client.bucket(gcs.bucket).blob(base + "manifest.json").download_as_bytes()) == m

    d = store.get_dir(path)
    assert d == store.cache_dir / "run-1" / "weights" / "step-0001"
    for name, data in FILES.items():
        assert (d / name).read_bytes() == data
        assert sha256_file(d / name) == m["files"][name]["sha256"] == hashlib.sha256(data).hexdigest()
    assert json.loads((d / "manifest.json").read_text()) == m
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_open_storage_gs_url(gcs, tmp_path):
    store = open_storage(f"gs://{gcs.bucket}/{PREFIX}", cache_dir=tmp_path / "c")
    assert isinstance(store, GCSStorage)
    assert (store.bucket_name, store.prefix, store.cache_dir, store.url) == (
        gcs.bucket, PREFIX, tmp_path / "c", f"gs://{gcs.bucket}/{PREFIX}")
    assert store.client.project == "openrl-test"
    path, m = put(store, "tinker://r/sampler_weights/s", {"a.bin": b"abc"}, tmp_path)
    assert gcs(prefix=PREFIX).manifest(path) == m


def test_create_only(gcs, tmp_path):
    store = gcs()
    path, first = put(store, "tinker://run-1/sampler_weights/final", {"a.bin": b"first" * 1000}, tmp_path)
    with pytest.raises(CheckpointExists):
        put(store, "tinker://run-1/sampler_weights/final", {"a.bin": b"second", "b.bin": b"x"}, tmp_path)
    assert store.manifest(path) == first
    assert gcs().get_dir(path).joinpath("a.bin").read_bytes() == b"first" * 1000
    base = f"{PREFIX}/run-1/sampler_weights/final/"
    assert object_names(gcs) == [base + "a.bin", base + "manifest.json"]


def test_create_only_per_object_and_no_manifest_on_conflict(gcs, tmp_path):
    """Objects without a manifest (a concurrent or crashed save) block the put at the object
    level (ifGenerationMatch=0); the put creates no manifest and removes what it uploaded."""
    store = gcs()
    base = f"{PREFIX}/run-2/weights/w/"
    bucket = gcs.client.bucket(gcs.bucket)
    bucket.blob(base + "b.bin").upload_from_string(b"someone else's")  # sorts after a.bin
    with pytest.raises(CheckpointExists):
        put(store, "tinker://run-2/weights/w", {"a.bin": b"mine", "b.bin": b"mine too"}, tmp_path)
    assert store.manifest(TinkerPath.parse("tinker://run-2/weights/w")) is None
    assert object_names(gcs) == [base + "b.bin"]  # our a.bin was cleaned up, theirs kept
    assert bucket.blob(base + "b.bin").download_as_bytes() == b"someone else's"


def test_failure_midway_leaves_no_manifest(gcs, tmp_path):
    store = gcs()
    orig, calls = store._upload_file, []

    def flaky(name, src):
        calls.append(name)
        if len(calls) == 2:
            raise ConnectionError("network went away")
        return orig(name, src)

    store._upload_file = flaky
    with pytest.raises(ConnectionError):
        put(store, "tinker://run-3/weights/w", FILES, tmp_path)
    path = TinkerPath.parse("tinker://run-3/weights/w")
    assert store.manifest(path) is None
    assert object_names(gcs) == []  # the one uploaded file was deleted again
    with pytest.raises(NotFound):
        store.get_dir(path)
    store._upload_file = orig
    _, m = put(store, "tinker://run-3/weights/w", FILES, tmp_path)  # the name is still free
    assert gcs().get_dir(path).joinpath("optimizer.pt").read_bytes() == FILES["optimizer.pt"]


def test_corrupted_object_detected_and_cache_not_polluted(gcs, tmp_path):
    writer = gcs()
    path, m = put(writer, "tinker://run-4/sampler_weights/s", FILES, tmp_path)
    name = f"{PREFIX}/run-4/sampler_weights/s/adapter_model.safetensors"
    bad = bytearray(FILES["adapter_model.safetensors"])
    bad[12345] ^= 0xFF
    gcs.client.bucket(gcs.bucket).blob(name).upload_from_string(bytes(bad))  # bit rot / tampering

    reader = gcs()
    with pytest.raises(ChecksumMismatch, match="adapter_model.safetensors"):
        reader.get_dir(path)
    run_cache = reader.cache_dir / "run-4" / "sampler_weights"
    assert not (run_cache / "s").exists()
    assert list(run_cache.iterdir()) == []  # the temp download dir is gone too

    gcs.client.bucket(gcs.bucket).blob(name).upload_from_string(FILES["adapter_model.safetensors"])  # repaired
    assert reader.get_dir(path).joinpath("adapter_model.safetensors").read_bytes() == FILES["adapter_model.safetensors"]


def test_corrupted_local_cache_is_downloaded_again(gcs, tmp_path):
    store = gcs()
    path, _ = put(store, "tinker://run-5/sampler_weights/s", FILES, tmp_path)
    d = store.get_dir(path)
    (d / "optimizer.pt").write_bytes(b"garbage")
    calls = count_downloads(store)
    assert store.get_dir(path) == d
    assert (d / "optimizer.pt").read_bytes() == FILES["optimizer.pt"]
    assert len(calls) == len(FILES)


def test_cache_is_reused(gcs, tmp_path):
    store = gcs(cache_dir=tmp_path / "shared-cache")
    path, _ = put(store, "tinker://run-6/sampler_weights/s", FILES, tmp_path)
    calls = count_downloads(store)
    d1 = store.get_dir(path)
    assert len(calls) == len(FILES)
    mtimes = {p.name: p.stat().st_mtime_ns for p in d1.iterdir()}
    assert store.get_dir(path) == d1
    assert len(calls) == len(FILES)  # second get: no file download (only the manifest is read)

    restarted = gcs(cache_dir=tmp_path / "shared-cache")  # a new process on the same disk
    calls2 = count_downloads(restarted)
    assert restarted.get_dir(path) == d1
    assert calls2 == []  # verified by sha256 from disk, not downloaded
    assert {p.name: p.stat().st_mtime_ns for p in d1.iterdir()} == mtimes


def test_cache_follows_manifest_updates_and_deletes(gcs, tmp_path):
    a, b = gcs(), gcs()
    path, m = put(a, "tinker://run-7/sampler_weights/s", FILES, tmp_path)
    d = b.get_dir(path)
    m["public"] = True
    a.write_manifest(path, m)
    assert json.loads((b.get_dir(path) / "manifest.json").read_text())["public"] is True
    a.delete(path)
    with pytest.raises(NotFound):
        b.get_dir(path)
    assert not d.exists()  # the replica dropped its stale copy


def test_two_sampler_replicas_get_identical_bytes(gcs, tmp_path):
    trainer = gcs()
    path, m = put(trainer, "tinker://run-8/sampler_weights/s", FILES, tmp_path)
    r1, r2 = gcs(cache_dir=tmp_path / "replica1"), gcs(cache_dir=tmp_path / "replica2")
    d1, d2 = r1.get_dir(path), r2.get_dir(path)
    assert d1 != d2
    for name in FILES:
        assert (d1 / name).read_bytes() == (d2 / name).read_bytes() == FILES[name]


def test_concurrent_readers_share_one_cache_dir(gcs, tmp_path):
    """Two replicas on one disk (and threads in each) never see a half-written cache."""
    trainer = gcs()
    path, m = put(trainer, "tinker://run-9/sampler_weights/s", FILES, tmp_path)
    readers = [gcs(cache_dir=tmp_path / "one-disk") for _ in range(2)]
    results, errors = [], []
    start = threading.Barrier(6)

    def read(store):
        try:
            start.wait()
            d = store.get_dir(path)
            results.append({n: (d / n).read_bytes() for n in FILES})
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(readers[i % 2],)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 6 and all(r == FILES for r in results)
    assert [p.name for p in (tmp_path / "one-disk" / "run-9" / "sampler_weights").iterdir()] == ["s"]


def test_list_run_list_runs_write_manifest_delete(gcs, tmp_path):
    store = gcs()
    created = {}
    for p in ["tinker://run-a/weights/002", "tinker://run-a/sampler_weights/001", "tinker://run-a/weights/001",
              "tinker://run-b/sampler_weights/x"]:
        created[p] = put(store, p, {"f.bin": p.encode()}, tmp_path)[1]
    assert store.list_runs() == ["run-a", "run-b"]
    assert [m["tinker_path"] for m in store.list_run("run-a")] == [
        "tinker://run-a/weights/001", "tinker://run-a/weights/002", "tinker://run-a/sampler_weights/001"]
    assert store.list_run("run-none") == []
    with pytest.raises(UserError):
        store.list_run("../escape")

    # write_manifest: only the manifest changes
    path = TinkerPath.parse("tinker://run-a/weights/001")
    m = store.manifest(path)
    m.update(public=True, ttl_seconds=60, expires_unix=time.time() + 60)
    store.write_manifest(path, m)
    assert store.manifest(path) == m
    assert store.get_dir(path).joinpath("f.bin").read_bytes() == b"tinker://run-a/weights/001"
    with pytest.raises(UserError, match="immutable"):
        store.write_manifest(path, {**m, "files": {}})

    # delete: every object under the prefix, nothing else
    store.delete(path)
    assert store.manifest(path) is None
    assert object_names(gcs, f"{PREFIX}/run-a/weights/001/") == []
    assert len(object_names(gcs, f"{PREFIX}/run-a/")) == 4  # the other two checkpoints of run-a
    assert [m["tinker_path"] for m in store.list_run("run-a")] == [
        "tinker://run-a/weights/002", "tinker://run-a/sampler_weights/001"]
    with pytest.raises(NotFound):
        store.delete(path)
    with pytest.raises(NotFound):
        store.write_manifest(path, m)  # a deleted checkpoint is not re-created
    assert object_names(gcs, f"{PREFIX}/run-a/weights/001/") == []

    # a bucket shared with other data / an empty prefix
    gcs.client.bucket(gcs.bucket).blob("unrelated/object").upload_from_string(b"x")
    assert store.list_runs() == ["run-a", "run-b"]
    assert "ckpts" in gcs(prefix="").list_runs()


@pytest.mark.parametrize("backend", ["file", "gcs"])
def test_sweep_expired(backend, gcs, tmp_path):
    store = FileStorage(tmp_path / "fs") if backend == "file" else gcs()
    old, _ = put(store, "tinker://run-s/weights/old", {"a": b"1"}, tmp_path, ttl=10)
    keep, _ = put(store, "tinker://run-s/weights/keep", {"a": b"2"}, tmp_path, ttl=100_000)
    forever, _ = put(store, "tinker://run-t/sampler_weights/forever", {"a": b"3"}, tmp_path)
    also_old, _ = put(store, "tinker://run-t/sampler_weights/old", {"a": b"4"}, tmp_path, ttl=5)

    assert sweep_expired(store) == []  # nothing has expired yet
    later = time.time() + 60
    assert sorted(sweep_expired(store, now=later)) == sorted([str(old), str(also_old)])
    assert store.manifest(old) is None and store.manifest(also_old) is None
    assert store.manifest(keep) is not None and store.manifest(forever) is not None
    with pytest.raises(NotFound):
        store.get_dir(old)
    assert sweep_expired(store, now=later) == []
    assert sweep_expired(store, now=time.time() + 10**9) == [str(keep)]


def test_large_object_streams(gcs, tmp_path):
    """A ~50 MB checkpoint file goes up and down without a whole-file copy in memory."""
    size = 50 << 20
    src = tmp_path / "big"
    src.mkdir()
    with open(src / "adapter_model.safetensors", "wb") as f:
        for _ in range(size >> 20):
            f.write(os.urandom(1 << 20))
    path = TinkerPath.parse("tinker://run-big/weights/w")
    m = build_manifest(src, path, owner="alice", ttl_seconds=None, extra={})
    writer, reader = gcs(), gcs()

    tracemalloc.start()
    try:
        writer.put_dir(path, src, m)
        _, up_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        d = reader.get_dir(path)
        _, down_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sha256_file(d / "adapter_model.safetensors") == m["files"]["adapter_model.safetensors"]["sha256"]
    # upload holds one resumable chunk (8 MiB) plus a copy at most; download streams small blocks
    assert up_peak < 0.5 * size, f"upload peak {up_peak / 2**20:.1f} MiB for a {size >> 20} MiB file"
    assert down_peak < 0.2 * size, f"download peak {down_peak / 2**20:.1f} MiB for a {size >> 20} MiB file"


@pytest.mark.parametrize("backend", ["file", "gcs"])
def test_copy_inside_the_store(backend, gcs, tmp_path):
    """Storage.copy (copy_weights): the files of a checkpoint under a new path with a new
    manifest, verified on read; create-only; the source stays; deleting the source leaves the
    copy readable; a missing source is NotFound. GCS copies server-side (no download)."""
    store = FileStorage(tmp_path / "fs") if backend == "file" else gcs()
    src, m = put(store, "tinker://run-c/weights/s1", FILES, tmp_path)
    dst = TinkerPath.parse("tinker://run-d/weights/s1")
    manifest = {**m, "tinker_path": str(dst), "training_run_id": "run-d", "owner": "bob", "copied_from": str(src)}
    downloads = count_downloads(store) if backend == "gcs" else []
    assert store.copy(src, dst, manifest) == manifest
    assert downloads == []
    assert store.manifest(dst) == manifest and store.manifest(src) == m
    with pytest.raises(CheckpointExists):
        store.copy(src, dst, manifest)
    with pytest.raises(NotFound):
        store.copy(TinkerPath.parse("tinker://run-c/weights/none"), TinkerPath.parse("tinker://run-e/weights/x"), m)
    store.delete(src)
    got = store.get_dir(dst)
    assert {f.name: f.read_bytes() for f in got.iterdir() if f.name != "manifest.json"} == FILES
    assert [x["tinker_path"] for x in store.list_run("run-d")] == [str(dst)]
