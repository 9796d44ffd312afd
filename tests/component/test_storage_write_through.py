"""Weights to a co-located sampler without the round trip through the bucket (issue 12 item 6):
a trainer's ``GCSStorage(write_through=True)`` keeps each sampler snapshot it uploads as the
verified cached copy in the cache dir it shares with the sampler on the same machine, so the
sampler's ``get_dir`` reads it locally (page cache) instead of downloading it back. The snapshot
is still uploaded whole, manifest last (durable and immutable as before).

Real GCS emulator (fake-gcs-server on 127.0.0.1) and the real google-cloud-storage client;
``_download_file`` is wrapped only to count downloads.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from fixtures_gcs import count_downloads, gcs_emulator  # noqa: F401
from openrl.storage import TinkerPath, build_manifest, open_storage, sha256_file
from openrl.storage.gcs import GCSStorage, make_client

FILES = {"adapter_model.safetensors": os.urandom(3 << 20), "adapter_config.json": b'{"r": 8}'}


@pytest.fixture
def bucket(gcs_emulator, monkeypatch):  # noqa: F811
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    name = f"openrl-wt-{uuid.uuid4().hex[:10]}"
    make_client().create_bucket(name)
    return name


def _save(trainer: GCSStorage, path: str) -> TinkerPath:
    """As ``TrainerFunction._save``: stage in ``scratch_dir()``, ``put_dir``, remove the stage."""
    import shutil
    import tempfile

    p = TinkerPath.parse(path)
    tmp = Path(tempfile.mkdtemp(prefix="openrl-save-", dir=trainer.scratch_dir()))
    try:
        for name, data in FILES.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        trainer.put_dir(p, tmp, build_manifest(tmp, p, owner="alice", ttl_seconds=None, extra={}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return p




def test_colocated_sampler_reads_the_snapshot_without_downloading(bucket, tmp_path):
    cache = tmp_path / "cache"  # <OPENRL_HOME>/cache, shared by the stack's trainer and sampler
    trainer = open_storage(f"gs://{bucket}/ck", cache_dir=cache, write_through=True)
    sampler = open_storage(f"gs://{bucket}/ck", cache_dir=cache)  # another process: no verified memo
    p = _save(trainer, "tinker://run1/sampler_weights/s0")
    got = count_downloads(sampler)
    d = sampler.get_dir(p)
    assert got == []  # read from the shared cache, verified by sha256 against the bucket's manifest
    for name, data in FILES.items():
        assert (d / name).read_bytes() == data
    # still durable: a sampler elsewhere (its own cache) downloads the same bytes from the bucket
    remote = open_storage(f"gs://{bucket}/ck", cache_dir=tmp_path / "elsewhere")
    far = count_downloads(remote)
    d2 = remote.get_dir(p)
    assert sorted(far) and all(sha256_file(d2 / n) == sha256_file(d / n) for n in FILES)
    # the stage was linked, not copied: the cached file is the one the trainer wrote
    assert not any((cache / ".scratch").iterdir())


def test_without_write_through_or_for_other_kinds_the_samplercount_downloads(bucket, tmp_path):
    cache = tmp_path / "cache"
    plain = open_storage(f"gs://{bucket}/ck", cache_dir=cache)
    wt = open_storage(f"gs://{bucket}/ck", cache_dir=cache, write_through=True)
    p1 = _save(plain, "tinker://run1/sampler_weights/s1")
    p2 = _save(wt, "tinker://run1/weights/ckpt")  # a training checkpoint: not what a sampler reads next
    sampler = open_storage(f"gs://{bucket}/ck", cache_dir=cache)
    got = count_downloads(sampler)
    sampler.get_dir(p1)
    sampler.get_dir(p2)
    assert len(got) == 2 * len(FILES)


def test_a_tampered_cached_copy_is_downloaded_again(bucket, tmp_path):
    cache = tmp_path / "cache"
    trainer = open_storage(f"gs://{bucket}/ck", cache_dir=cache, write_through=True)
    p = _save(trainer, "tinker://run1/sampler_weights/s2")
    cached = cache / p.key / "adapter_model.safetensors"
    data = bytearray(cached.read_bytes())
    data[0] ^= 1
    os.unlink(cached)  # (a hard link: write a new file, as a corrupting process would)
    cached.write_bytes(bytes(data))
    sampler = open_storage(f"gs://{bucket}/ck", cache_dir=cache)
    got = count_downloads(sampler)
    d = sampler.get_dir(p)
    assert "adapter_model.safetensors" in " ".join(got)
    assert (d / "adapter_model.safetensors").read_bytes() == FILES["adapter_model.safetensors"]
