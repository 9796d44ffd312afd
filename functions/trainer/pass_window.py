"""Sampler snapshots packed beside a packed pass (issue 31): the engine lock, shared.

An unnamed ``save_weights_for_sampler`` packs the run's adapter into a device buffer
(:meth:`functions.trainer.run_state.RunStateIO.pack_sampler_snapshot`, a ``torch.cat`` of the
run's float32 LoRA tensors) and needs only that no engine operation changes those tensors or
where they live meanwhile: an optimizer step, a create, load, unload, idle sleep or wake. All of
those hold the trainer's engine lock. So does a forward(_backward) pass, which reads the adapter
weights and writes only gradients and activations. Measured on an H200 (docs/benchmarks.md,
seventeenth session, the sweep's 8-run rounds): a save waited 0.37 s for the pass before it,
against 0.04 s alone.

:class:`PassWindow` lets a pack run while a pass holds the lock: the pass opens the window
(:meth:`PassWindow.open`) around its engine call and, before it lets the lock go, waits for the
packs that started inside it, so no lock holder that changes weights can start while one is
under way. Outside an open window a pack takes the engine lock as before. Only single-device
engines share the window (their pass and pack run in two threads of one process and queue their
kernels on the same CUDA stream, so a pack reads the weights the last optimizer step wrote);
the multi-GPU engine's pack is a collective of its ranks and always takes the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator


def single_device(engine: Any) -> bool:
    """Whether ``engine`` runs in this process on one device (a ``TrainerEngine``, not the
    multi-GPU ``DistributedTrainerEngine``, which has no ``model`` here)."""
    return hasattr(engine, "model") and hasattr(engine, "runs")


class PassWindow:
    """The engine lock, and the window in which snapshot packs may run beside a pass.

    Args:
        lock: the trainer's engine lock (one engine computation at a time).
        enabled: ``Settings.pack_beside_pass``; False: every pack takes the lock.

    Attributes:
        beside: packs that ran inside an open window (for tests and metrics).
    """

    def __init__(self, lock: asyncio.Lock, *, enabled: bool = True):
        self.lock = lock
        self.enabled = bool(enabled)
        self._open = False
        self._packs = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.beside = 0

    @contextlib.asynccontextmanager
    async def open(self, engine: Any) -> AsyncIterator[None]:
        """Around a pass's engine call; the caller holds :attr:`lock`. On exit, waits for the
        packs started inside the window (each a few device copies) before returning."""
        if not (self.enabled and single_device(engine)):
            yield
            return
        self._open = True
        try:
            yield
        finally:
            self._open = False
            await self._idle.wait()

    @contextlib.asynccontextmanager
    async def pack(self, engine: Any) -> AsyncIterator[bool]:
        """Around a snapshot's pack of ``engine``'s run: inside an open window without waiting
        (yields True), else holding the engine lock (yields False)."""
        if self._open and single_device(engine):  # no await between the check and the count
            self._packs += 1
            self._idle.clear()
            self.beside += 1
            try:
                yield True
            finally:
                self._packs -= 1
                if self._packs == 0:
                    self._idle.set()
            return
        async with self.lock:
            yield False


__all__ = ["PassWindow", "single_device"]
