"""openrl/storage/compile_cache.py against a real GCS emulator (fake-gcs-server, the real
google-cloud-storage client) and file storage: a pod that starts with empty cache directories
gets the files an earlier pod compiled, and only a start that compiled something new stores
the archive again. The vLLM engine that fills the directories runs only on a GPU; here the
"compiled artefacts" are files written by the test."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from fixtures_gcs import file_or_gcs_storage, gcs_emulator  # noqa: F401  (session fixture)
from openrl.storage.compile_cache import PREFIX, cache_dirs, cache_tag, enabled, restore, save

TAG = cache_tag("2.11.0+cu130", "0.24.0", "NVIDIA H100 80GB HBM3")


@pytest.fixture(params=["gcs", "file"])
def storage(request, tmp_path, monkeypatch):
    return file_or_gcs_storage(request.param, request, tmp_path, monkeypatch)


def _pod(root: Path) -> dict[str, Path]:
    """The cache directories of one pod (an empty /tmp/cache at each start)."""
    env = {"VLLM_CACHE_ROOT": str(root / "vllm"), "TRITON_CACHE_DIR": str(root / "triton")}
    return cache_dirs(env)


def _compile(dirs: dict[str, Path], files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        name, _, path = rel.partition("/")
        p = dirs[name] / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


FIRST = {"vllm/torch_compile_cache/a8137a33b6/rank_0_0/backbone/artifact": b"x" * 70_000,
         "vllm/torch_aot_compile/e654/rank_0_0/model": b"aot",
         "triton/ABC/_lora_shrink.cubin": b"cubin"}


def test_a_new_pod_starts_with_what_the_first_one_compiled(storage, tmp_path):
    pod1 = _pod(tmp_path / "pod1")
    got = restore(storage, pod1, TAG)
    assert not got["found"] and got["files"] == 0  # the very first start: nothing stored yet
    _compile(pod1, FIRST)
    stored = save(storage, pod1, TAG, got["known"])
    assert stored["stored"] and stored["new"] == 3

    pod2 = _pod(tmp_path / "pod2")
    got2 = restore(storage, pod2, TAG)
    assert got2["found"] and got2["files"] == 3
    for rel, data in FIRST.items():
        name, _, path = rel.partition("/")
        assert (pod2[name] / path).read_bytes() == data
    # nothing new compiled: nothing stored again
    assert save(storage, pod2, TAG, got2["known"]) == {"stored": False, "files": 3, "new": 0, "bytes": 0,
                                                       "s": pytest.approx(0, abs=5)}
    # a start that compiled one more graph stores the union
    _compile(pod2, {"vllm/torch_compile_cache/ffff/rank_0_0/backbone/artifact": b"y"})
    assert save(storage, pod2, TAG, got2["known"])["new"] == 1
    pod3 = _pod(tmp_path / "pod3")
    assert restore(storage, pod3, TAG)["files"] == 4
    # another tag (another GPU or vLLM version) sees nothing
    assert not restore(storage, _pod(tmp_path / "pod4"), cache_tag("2.11.0", "0.25.0", "NVIDIA H200"))["found"]


def test_files_already_there_are_kept(storage, tmp_path):
    pod1 = _pod(tmp_path / "pod1")
    _compile(pod1, FIRST)
    save(storage, pod1, TAG, {})
    pod2 = _pod(tmp_path / "pod2")
    _compile(pod2, {"triton/ABC/_lora_shrink.cubin": b"local"})
    got = restore(storage, pod2, TAG)
    assert got["files"] == 2 and (pod2["triton"] / "ABC/_lora_shrink.cubin").read_bytes() == b"local"


def test_a_bad_archive_is_skipped_not_raised(storage, tmp_path):
    """A truncated archive, or one with a member that leaves its directory, costs a compile."""
    bad = tmp_path / "bad.tar.gz"
    evil = tmp_path / "evil"
    evil.write_bytes(b"evil")
    with tarfile.open(bad, "w:gz") as tf:
        tf.add(evil, arcname="vllm/../../escaped")
    storage.put_file(f"{PREFIX}/{TAG}.tar.gz", bad)
    pod = _pod(tmp_path / "pod")
    got = restore(storage, pod, TAG)
    assert got["found"] and got["files"] == 0
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "pod" / "escaped").exists()
    bad.write_bytes(b"\x1f\x8b not really gzip")
    storage.put_file(f"{PREFIX}/{TAG}.tar.gz", bad)
    assert restore(storage, _pod(tmp_path / "pod5"), TAG)["files"] == 0


def test_cache_dirs_tag_and_mode():
    assert cache_dirs({"VLLM_CACHE_ROOT": "/tmp/cache/vllm", "TRITON_CACHE_DIR": ""}) == {"vllm": Path("/tmp/cache/vllm")}
    assert TAG == "torch-2.11.0-cu130_vllm-0.24.0_NVIDIA-H100-80GB-HBM3"
    assert cache_tag("2.13.0+cpu", None, None) == "torch-2.13.0-cpu_vllm-none_cpu"
    assert enabled("auto", "gs://bucket/x") and not enabled("auto", "file:///tmp/s")
    assert enabled("on", "file:///tmp/s") and not enabled("off", "gs://bucket/x")


async def test_the_sampler_function_restores_before_its_engine_and_stores_after(micro_model_dir, tmp_path,
                                                                                 monkeypatch):
    """SamplerFunction with ``compile_cache_sync=on`` (file storage; on GKE ``auto`` turns it on
    for ``gs://``): the first sampler finds nothing, and after its engine loaded stores what its
    cache directories hold; a second sampler with empty directories gets those files back
    before its engine starts (start-up phase ``compile_cache_restore``). The CPU engine compiles
    nothing; a file stands in for vLLM's artefacts."""
    from functions.sampler.function import SamplerFunction
    from openrl.model.registry import ModelRegistry
    from openrl.observe import startup

    reg = ModelRegistry.from_dict({"models": {"micro": {"path": str(micro_model_dir)}}}, models_dir=tmp_path)
    store = (tmp_path / "store").as_uri()

    async def sampler(cache: Path) -> SamplerFunction:
        monkeypatch.setenv("VLLM_CACHE_ROOT", str(cache))
        f = SamplerFunction()
        await f.start({"registry_obj": reg, "storage_url": store, "device": "cpu", "sampler_backend": "hf",
                       "compile_cache_sync": "on", "preload": ["micro"]})
        if f.compile_cache.saving is not None:
            await f.compile_cache.saving
        return f

    first_cache = tmp_path / "pod1"
    (first_cache / "torch_compile_cache").mkdir(parents=True)
    (first_cache / "torch_compile_cache" / "graph").write_bytes(b"compiled")
    f1 = await sampler(first_cache)
    try:
        assert f1.compile_cache.last["restore"]["found"] is False
        assert f1.compile_cache.last["save"]["stored"] and f1.compile_cache.last["save"]["new"] == 1
    finally:
        await f1.stop()
    f2 = await sampler(tmp_path / "pod2")
    try:
        assert f2.compile_cache.last["restore"]["files"] == 1
        assert (tmp_path / "pod2" / "torch_compile_cache" / "graph").read_bytes() == b"compiled"
        assert f2.compile_cache.last["save"]["stored"] is False, f2.compile_cache.last  # nothing new compiled
        assert "compile_cache_restore" in startup.phases()
        assert f2.describe()["compile_cache"] == "restored 1 files"
    finally:
        await f2.stop()
