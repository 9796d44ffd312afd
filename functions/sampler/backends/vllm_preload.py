"""Adapter loads off vLLM's engine-core loop (issue 31; ``OPENRL_VLLM_PRELOAD``, default on).

``AsyncLLM.add_lora`` is a utility call that vLLM's engine core runs on its one loop, between
engine steps: while it reads the adapter file, casts it to the serving dtype, pins it, packs
q/k/v and gate/up and pins those (``LRUCacheWorkerLoRAManager._load_adapter``,
``LoRAModelManager._create_merged_loras_inplace``), no sequence of any run decodes. With 8 RL runs
the loads of one round queue there one after another (measured through the stack on an H100,
2026-12-05: 1.9 s per load with 8 runs, 0.6 s with one; vLLM's own add_lora alone 0.07-0.2 s).

:class:`LoRAPreloadExtension` is a vLLM worker extension (``worker_extension_cls``; it runs in
the worker, which is the engine-core process on one GPU). The sampler asks it, through
``collective_rpc``, to build the adapter's ``LoRAModel`` (read, cast, pin, pack, pin: vLLM's own
functions, called unchanged) in a small thread pool, polls until it is built, then calls
``add_lora`` as before: the worker manager's ``_load_adapter`` then hands back the model built
in the background, so on the loop only the registration and the copy into a GPU slot remain.
An error in the background build is raised by that ``add_lora`` exactly as vLLM raises it.

vLLM is imported only inside the methods (CPU tests use stand-in managers).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

#: Adapters built at once in the background by default (each holds the GIL only between torch
#: calls); ``Settings.vllm_preload_threads`` / ``$OPENRL_VLLM_PRELOAD_THREADS`` sets it.
PRELOAD_THREADS = 2
#: ``vllm.config.ParallelConfig.worker_extension_cls`` value that installs the extension.
EXTENSION_QUALNAME = "functions.sampler.backends.vllm_preload.LoRAPreloadExtension"


class Preloader:
    """Background adapter builds for one ``LRUCacheWorkerLoRAManager`` (``manager``).

    Installs two wrappers on the manager's instances (not classes): ``manager._load_adapter``
    returns a background-built ``LoRAModel`` for a preloaded id (waiting for it if needed, raising
    its error), else calls vLLM's own; ``manager._adapter_manager._create_merged_loras_inplace``
    skips a model the background build has packed already.
    """

    def __init__(self, manager, threads: int = PRELOAD_THREADS):
        self.manager = manager
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(threads)), thread_name_prefix="openrl-lora-preload")
        self._jobs: dict[int, tuple[str, Future]] = {}  # lora id -> (path, build)
        self._lock = threading.Lock()
        self._load = manager._load_adapter
        adapters = manager._adapter_manager
        self._merge = adapters._create_merged_loras_inplace

        def load_adapter(lora_request):
            with self._lock:
                job = self._jobs.get(lora_request.lora_int_id)
                if job is not None and job[0] == lora_request.lora_path:
                    del self._jobs[lora_request.lora_int_id]
                else:
                    job = None
            if job is None:
                return self._load(lora_request)
            return job[1].result()  # the background build's model, or its exception

        def merge(lora_model):
            if getattr(lora_model, "_openrl_packed", False):
                return None
            return self._merge(lora_model)

        manager._load_adapter = load_adapter
        adapters._create_merged_loras_inplace = merge

    def _build(self, lora_request):
        lora = self._load(lora_request)
        self._merge(lora)
        lora._openrl_packed = True
        return lora

    def start(self, name: str, lora_id: int, path: str) -> bool:
        """Start building adapter ``lora_id`` from ``path`` (a no-op if it is under way or built).
        Returns True."""
        from vllm.lora.request import LoRARequest

        with self._lock:
            if lora_id in self._jobs:
                return True
            req = LoRARequest(lora_name=name, lora_int_id=int(lora_id), lora_path=str(path))
            self._jobs[int(lora_id)] = (str(path), self._pool.submit(self._build, req))
        return True

    def state(self, lora_id: int) -> str:
        """``"none"`` (not preloaded, or taken by ``add_lora``), ``"pending"``, ``"ready"`` or
        ``"error: <type>: <message>"`` (``add_lora`` raises it)."""
        with self._lock:
            job = self._jobs.get(int(lora_id))
        if job is None:
            return "none"
        fut = job[1]
        if not fut.done():
            return "pending"
        exc = fut.exception()
        return "ready" if exc is None else f"error: {type(exc).__name__}: {str(exc)[:300]}"

    def drop(self, lora_id: int) -> bool:
        """Forget a preload that will not be added (its model is freed once built)."""
        with self._lock:
            return self._jobs.pop(int(lora_id), None) is not None


_PRELOADERS: dict[int, Preloader] = {}
_PRELOADERS_LOCK = threading.Lock()


def preloader_of(worker) -> Preloader:
    """The :class:`Preloader` of ``worker``'s LoRA manager (``worker.model_runner.lora_manager``),
    made on first use with ``Settings().vllm_preload_threads`` threads (the worker inherits the
    sampler's environment).

    Raises:
        RuntimeError: the worker's model runner has no LoRA manager (LoRA not enabled).
    """
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None:
        raise RuntimeError("the vLLM worker has no LoRA manager (enable_lora is off)")
    with _PRELOADERS_LOCK:
        p = _PRELOADERS.get(id(manager))
        if p is None or p.manager is not manager:
            from openrl.config import Settings

            p = _PRELOADERS[id(manager)] = Preloader(manager, threads=Settings().vllm_preload_threads)
        return p


class LoRAPreloadExtension:
    """vLLM worker extension (``worker_extension_cls``): the ``collective_rpc`` methods the
    vLLM sampler backend calls when ``OPENRL_VLLM_PRELOAD`` is on (see the module docstring).
    Its method names must not exist on vLLM's worker class (vLLM asserts it)."""

    def openrl_preload_lora(self, name: str, lora_id: int, path: str) -> bool:
        """Start building adapter ``lora_id`` (``name``, PEFT directory ``path``) in the background."""
        return preloader_of(self).start(name, lora_id, path)

    def openrl_preload_state(self, lora_id: int) -> str:
        """:meth:`Preloader.state` of ``lora_id``."""
        return preloader_of(self).state(lora_id)

    def openrl_preload_drop(self, lora_id: int) -> bool:
        """:meth:`Preloader.drop` of ``lora_id``."""
        return preloader_of(self).drop(lora_id)


__all__ = ["EXTENSION_QUALNAME", "LoRAPreloadExtension", "PRELOAD_THREADS", "Preloader", "preloader_of"]
