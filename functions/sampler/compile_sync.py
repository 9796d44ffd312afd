"""The sampler's side of :mod:`openrl.storage.compile_cache`: fetch the compile caches before
the first engine starts, store them once it is up (in the background)."""

from __future__ import annotations

import asyncio
import logging

from openrl.observe import startup
from openrl.storage import compile_cache

log = logging.getLogger(__name__)


def _tag(device: str) -> str:
    import importlib.metadata

    import torch

    try:
        vllm_version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = None
    return compile_cache.cache_tag(torch.__version__, vllm_version, _gpu_name(device, vllm_version is not None))


def _gpu_name(device: str, have_vllm: bool) -> str | None:
    """The GPU's name (e.g. ``NVIDIA H100 80GB HBM3``), or None on a CPU device.

    With vLLM installed the name comes from ``vllm.platforms.current_platform`` (NVML), which
    leaves CUDA uninitialised in this process, so vLLM can still fork its engine core from it
    (``torch.cuda.get_device_name`` initialises CUDA, and vLLM then falls back to the slower
    spawn). Without vLLM, torch's name."""
    import torch

    if not str(device).startswith("cuda"):
        return None
    index = torch.device(device).index or 0
    if have_vllm:
        try:
            from vllm.platforms import current_platform

            return str(current_platform.get_device_name(index))
        except Exception as exc:  # noqa: BLE001 - torch's name below (and a spawned engine core)
            log.info("GPU name from vLLM's platform failed (%s); asking torch", exc)
    return torch.cuda.get_device_name(index) if torch.cuda.is_available() else None


class CompileCacheSync:
    """One per sampler process.

    Args:
        storage: the sampler's :class:`openrl.storage.Storage`.
        device: the sampler's device (``cpu``, ``cuda``, ``cuda:N``).
        on: whether to sync (:func:`openrl.storage.compile_cache.enabled`).
    """

    def __init__(self, storage, device: str, on: bool):
        self.storage, self.device, self.on = storage, device, on
        self.known: dict[str, int] | None = None  # None: not restored yet
        self.saving: asyncio.Task | None = None
        self.last: dict = {}
        self.tag: str | None = None  # the archive's name (compile_cache.cache_tag), set by restore_once

    async def restore_once(self) -> None:
        """Before the first engine: point vLLM at its cache directory (as the backend would) and
        unpack the stored archive there (start-up phase ``compile_cache_restore``)."""
        if not self.on or self.known is not None:
            return
        from functions.sampler.backends.vllm_settings import configure_vllm_env

        configure_vllm_env()  # VLLM_CACHE_ROOT, set before vLLM's import either way
        self.tag = _tag(self.device)
        with startup.timed("compile_cache_restore"):
            got = await asyncio.to_thread(compile_cache.restore, self.storage, compile_cache.cache_dirs(), self.tag)
        self.known = got.pop("known")
        self.last = {"restore": got}

    def save_soon(self) -> None:
        """After an engine started: store the caches when the start added files (background)."""
        if not self.on or self.known is None or (self.saving is not None and not self.saving.done()):
            return

        async def run() -> None:
            try:
                got = await asyncio.to_thread(compile_cache.save, self.storage, compile_cache.cache_dirs(),
                                              self.tag, self.known)
                self.last["save"] = got
            except Exception as exc:  # noqa: BLE001 - a cache never fails the sampler
                log.warning("compile cache not stored: %s", exc)
                self.last["save"] = {"error": str(exc)[:300]}

        self.saving = asyncio.get_running_loop().create_task(run())

    def describe(self) -> str | None:
        """What ``openrl status`` shows (``compile_cache``): the restore and the last store, or
        None when the sync is off or has not run."""
        if not self.on or not self.last:
            return None
        r, w = self.last.get("restore", {}), self.last.get("save", {})
        out = f"restored {r.get('files', 0)} files" if r.get("found") else "none stored yet"
        if "error" in w:
            return f"{out}; store failed: {w['error']}"
        return f"{out}; stored {w['new']} new files" if w.get("stored") else out
