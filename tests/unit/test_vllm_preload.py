"""The background adapter build in vLLM's worker (``OPENRL_VLLM_PRELOAD``,
functions/sampler/backends/vllm_preload.py) and the vLLM backend's use of it.

vLLM's worker and engine need a CUDA GPU: here stand-in LoRA managers take the place of vLLM's
``LRUCacheWorkerLoRAManager`` / ``LoRAModelManager`` (same method names, same call order as
vLLM 0.24's ``add_adapter``: ``_load_adapter`` then ``_adapter_manager._create_merged_loras_inplace``),
a stand-in ``vllm.lora.request`` module gives the request type, and a stand-in engine forwards
``collective_rpc`` / ``add_lora`` to the extension in this process. The real worker runs in the GPU
stack bench (``bench/device_call.sh stack-after-conform`` with ``AB_ENV=OPENRL_VLLM_PRELOAD=1``).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import types
from types import SimpleNamespace

import pytest

from functions.sampler.backends import vllm_preload
from functions.sampler.backends.vllm_preload import LoRAPreloadExtension, preloader_of
from openrl.errors import UserError


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm.lora.request")
    mod.LoRARequest = lambda **kw: SimpleNamespace(load_inplace=False, **kw)
    for name in ("vllm", "vllm.lora"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", mod)
    monkeypatch.setattr(vllm_preload, "_PRELOADERS", {})
    return mod


class Model:
    def __init__(self, req):
        self.id, self.path, self.merged = req.lora_int_id, req.lora_path, 0


class AdapterManager:
    def __init__(self):
        self.registered: dict[int, Model] = {}

    def _create_merged_loras_inplace(self, lora):
        lora.merged += 1


class Manager:
    """vLLM 0.24's ``LRUCacheWorkerLoRAManager.add_adapter`` order, reduced: load, merge, register."""

    def __init__(self, gate: threading.Event | None = None, fail: set[str] = frozenset()):
        self._adapter_manager = AdapterManager()
        self.loads: list[tuple[int, str]] = []  # (id, thread name) of each real load
        self.gate, self.fail = gate, fail

    def _load_adapter(self, req):
        if self.gate is not None:
            assert self.gate.wait(10)
        if req.lora_path in self.fail:
            raise ValueError(f"{req.lora_path} doesn't contain tensors")
        self.loads.append((req.lora_int_id, threading.current_thread().name))
        return Model(req)

    def add_adapter(self, req) -> bool:
        lora = self._load_adapter(req)
        self._adapter_manager._create_merged_loras_inplace(lora)
        self._adapter_manager.registered[lora.id] = lora
        return True


def worker_with(manager):
    w = LoRAPreloadExtension()
    w.model_runner = SimpleNamespace(lora_manager=manager)
    return w


def wait_state(w, lid, want, timeout=10.0):
    import time

    t0 = time.monotonic()
    while (st := w.openrl_preload_state(lid)) != want:
        assert time.monotonic() - t0 < timeout, st
        time.sleep(0.005)


def test_preloaded_adapter_is_built_off_the_loop_and_registered_once(fake_vllm):
    gate = threading.Event()
    m = Manager(gate=gate)
    w = worker_with(m)
    assert w.openrl_preload_lora("k1", 1, "/a/1") is True
    assert w.openrl_preload_state(1) == "pending"  # the build waits on the gate
    assert w.openrl_preload_lora("k1", 1, "/a/1") is True  # asked twice: one build
    gate.set()
    wait_state(w, 1, "ready")
    assert m.add_adapter(fake_vllm.LoRARequest(lora_name="k1", lora_int_id=1, lora_path="/a/1"))
    lora = m._adapter_manager.registered[1]
    assert lora.merged == 1  # packed in the background, not again on the loop
    assert [(i, t.startswith("openrl-lora-preload")) for i, t in m.loads] == [(1, True)]
    assert w.openrl_preload_state(1) == "none"  # taken by add_adapter


def test_adapter_without_preload_loads_as_vllm_does(fake_vllm):
    m = Manager()
    w = worker_with(m)
    w.openrl_preload_lora("k1", 1, "/a/1")
    wait_state(w, 1, "ready")
    m.add_adapter(fake_vllm.LoRARequest(lora_name="k2", lora_int_id=2, lora_path="/a/2"))
    assert m._adapter_manager.registered[2].merged == 1
    assert m.loads[-1] == (2, threading.current_thread().name)  # on the caller's thread
    # a preload for another path under the same id is not used
    m.add_adapter(fake_vllm.LoRARequest(lora_name="k1", lora_int_id=1, lora_path="/elsewhere"))
    assert m._adapter_manager.registered[1].path == "/elsewhere"
    assert w.openrl_preload_drop(1) is True and w.openrl_preload_state(1) == "none"


@pytest.mark.parametrize("threads", [1, 4])
def test_builds_at_once_follow_the_setting(fake_vllm, monkeypatch, threads):
    """``OPENRL_VLLM_PRELOAD_THREADS``: that many builds are under way at once (they meet at a
    barrier of that size; one more build waits for a thread)."""
    monkeypatch.setenv("OPENRL_VLLM_PRELOAD_THREADS", str(threads))
    meet, release = threading.Barrier(threads), threading.Event()
    inside: list[int] = []

    class Meeting(Manager):
        def _load_adapter(self, req):
            inside.append(req.lora_int_id)
            if req.lora_int_id < threads:  # the first `threads` builds meet: a BrokenBarrierError
                meet.wait(10)                # (a failed build) if fewer run at once
            assert release.wait(10)
            return super()._load_adapter(req)

    w = worker_with(Meeting())
    for i in range(threads + 1):
        w.openrl_preload_lora(f"k{i}", i, f"/a/{i}")
    t0 = time.monotonic()
    while len(inside) < threads:
        assert time.monotonic() - t0 < 10, inside
        time.sleep(0.005)
    time.sleep(0.05)  # (the last build would have started by now if a thread were free)
    assert sorted(inside) == list(range(threads))  # the last one waits for a thread
    release.set()
    for i in range(threads + 1):
        wait_state(w, i, "ready")


def test_failed_background_build_is_raised_by_add_adapter(fake_vllm):
    m = Manager(fail={"/bad"})
    w = worker_with(m)
    w.openrl_preload_lora("bad", 3, "/bad")
    wait_state(w, 3, "error: ValueError: /bad doesn't contain tensors")
    with pytest.raises(ValueError, match="doesn't contain tensors"):
        m.add_adapter(fake_vllm.LoRARequest(lora_name="bad", lora_int_id=3, lora_path="/bad"))
    assert 3 not in m._adapter_manager.registered


def test_worker_without_lora_is_a_clear_error(fake_vllm):
    w = LoRAPreloadExtension()
    w.model_runner = SimpleNamespace()
    with pytest.raises(RuntimeError, match="no LoRA manager"):
        w.openrl_preload_state(1)


def test_extension_names_do_not_shadow_vllm_worker_methods():
    """vLLM asserts that no attribute of the extension exists on its worker class; the
    extension's own names all carry the ``openrl_`` prefix."""
    names = [a for a in dir(LoRAPreloadExtension) if not a.startswith("__")]
    assert names and all(a.startswith("openrl_") for a in names)


def test_backend_preloads_then_adds(fake_vllm, tmp_path, monkeypatch):
    """VLLMBackend with preload on: collective_rpc starts the build, polls it, then add_lora
    registers the built model; a failed build becomes the load's UserError naming model_path."""
    from functions.sampler.backends.vllm import VLLMBackend
    from openrl.observe import metrics

    for d in ("good", "bad"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "adapter_model.safetensors").write_bytes(b"")
        (tmp_path / d / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
    gate = threading.Event()
    m = Manager(gate=gate, fail={str(tmp_path / "bad")})
    worker = worker_with(m)
    calls: list[str] = []

    class Engine:
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            calls.append(method)
            if method == "openrl_preload_state" and calls.count(method) == 3:
                gate.set()  # the build finishes while the backend polls
            return [getattr(worker, method)(*args)]

        async def add_lora(self, req):
            calls.append("add_lora")
            return m.add_adapter(req)

    be = VLLMBackend.__new__(VLLMBackend)
    be.engine, be._ids, be._requests, be._next_id = Engine(), {}, {}, 1
    be.max_lora_rank, be.unembed_lora, be._unembed_keys, be.preload = 32, "fallback", set(), True

    def total(part):
        return metrics.ADAPTER_LOAD_PART_SECONDS.labels(part)._sum.get()

    before = total("preload")
    asyncio.run(be.load_adapter("good", tmp_path / "good"))
    assert calls[0] == "openrl_preload_lora" and calls[-1] == "add_lora"
    assert calls.count("openrl_preload_state") >= 3
    assert be._ids == {"good": 1} and m._adapter_manager.registered[1].merged == 1
    assert m.loads[0][1].startswith("openrl-lora-preload")
    assert total("preload") > before
    with pytest.raises(UserError) as e:
        asyncio.run(be.load_adapter("bad", tmp_path / "bad"))
    assert e.value.field == "model_path" and "doesn't contain tensors" in str(e.value)
    assert "bad" not in be._ids
