"""Where a trainer engine's tensors live: on its device, or in host memory while the worker sleeps.

Idle sleep (:mod:`openrl.transport.bindings.idle_sleep`) moves everything a
:class:`~functions.trainer.engine.TrainerEngine` holds on its accelerator to host memory and
back (:func:`engine_slots` lists it):

- the frozen base weights and buffers (every ``nn.Module`` parameter and buffer of the model);
- every run's LoRA parameters and their accumulated gradients. They are *not* registered
  submodule parameters (``MultiLoRALinear.lora_A`` / ``lora_B`` are plain dicts), so
  ``Module.to`` would leave them on the device; they are listed through
  ``MultiLoRAModel.named_adapter_parameters``;
- every run's AdamW moments (``exp_avg``, ``exp_avg_sq``; the ``step`` counts already live on
  the host).

A parameter keeps its ``nn.Parameter`` object (its ``.data`` is swapped), so the optimizers'
references and tied weights stay valid. Nothing is dropped and no value changes: a tensor moved
to the host and back is bit for bit the same. After a move to the host the CUDA caching
allocator's free blocks are returned to the driver, so the memory is free to other processes
(the sampler's vLLM).

The host side is one flat ``uint8`` buffer per engine (:class:`HostStash`), page-locked with
``cudaHostRegister`` at its exact size, so both directions run at DMA speed; a pageable copy ran
at about 1.7 GB/s on an H100 host (7.2 s for 12.3 GB, ``bench/residency_probe.py``). The buffer
is kept after a wake and reused by the next sleep while it is large enough, so after its first
sleep the trainer process holds that much host memory (the engine's device bytes: about 16.6 GB
for Qwen3-4B with 8 rank-32 runs that hold gradients and moments).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)

_ALIGN = 512  # bytes: every tensor's view in the stash starts at a multiple of this


@dataclass
class Slot:
    """One tensor the engine holds, with how to put another tensor (same shape and dtype) in its place."""

    get: Callable[[], torch.Tensor]
    put: Callable[[torch.Tensor], None]


def _param_slot(p: torch.nn.Parameter) -> Slot:
    def put(t: torch.Tensor) -> None:
        g = p.grad
        if g is not None and g.device != t.device:  # a grad must live where its parameter does
            p.grad = None
        p.data = t

    return Slot(lambda: p.data, put)


def _grad_slot(p: torch.nn.Parameter) -> Slot:
    def put(t: torch.Tensor) -> None:
        p.grad = t

    return Slot(lambda: p.grad, put)


def _buffer_slot(owners: list[tuple[torch.nn.Module, str]]) -> Slot:
    m0, n0 = owners[0]

    def put(t: torch.Tensor) -> None:
        for m, n in owners:  # a buffer shared by several modules stays shared
            m._buffers[n] = t

    return Slot(lambda: m0._buffers[n0], put)


def _state_slot(st: dict, k: str) -> Slot:
    def put(t: torch.Tensor) -> None:
        st[k] = t

    return Slot(lambda: st[k], put)


def engine_slots(engine) -> list[Slot]:
    """Every tensor the engine holds (see the module doc), each once, in a fixed order: the
    parameters (base and adapters) first, then the gradients, buffers and optimizer moments.
    A gradient comes after its parameter, so moving in this order keeps them on one device."""
    params: dict[int, torch.nn.Parameter] = {}
    for p in engine.model.parameters():  # the base model (frozen), tied weights once
        params.setdefault(id(p), p)
    for run_id in engine.runs:
        for _, p in engine.model.named_adapter_parameters(run_id):
            params.setdefault(id(p), p)
    slots = [_param_slot(p) for p in params.values()]
    slots += [_grad_slot(p) for p in params.values() if p.grad is not None]
    buffers: dict[int, list] = {}
    for m in engine.model.modules():
        for n, b in m._buffers.items():
            if b is not None:
                buffers.setdefault(id(b), []).append((m, n))
    slots += [_buffer_slot(owners) for owners in buffers.values()]
    for run in engine.runs.values():
        for st in run.optimizer.opt.state.values():
            slots += [_state_slot(st, k) for k, v in st.items() if torch.is_tensor(v) and k != "step"]
    return slots


class HostStash:
    """A flat host buffer, page-locked (``cudaHostRegister``) at its exact size, that holds the
    engine's tensors while it sleeps. ``torch``'s pinned allocator would round 16 GB up to 32 GB
    (its caching host allocator rounds every block to a power of two).

    Attributes:
        buf: ``uint8`` CPU tensor [nbytes].
        registered: whether ``cudaHostRegister`` succeeded (otherwise the copies are pageable).
    """

    def __init__(self, nbytes: int, device: torch.device):
        self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.registered = False
        if device.type == "cuda" and nbytes:
            try:
                err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), nbytes, 0)  # cudaError_t
                self.registered = int(err) == 0
            except (AttributeError, RuntimeError) as exc:  # a torch build without the binding
                err = exc
            if not self.registered:
                log.warning("cudaHostRegister of %.2f GB failed (%s): sleep copies run pageable", nbytes / 1e9, err)

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def release(self) -> None:
        """Unregister and drop the buffer (no tensor may view it any more)."""
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            self.registered = False
        self.buf = torch.empty(0, dtype=torch.uint8)


def _layout(ts: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of ``ts`` packed one after another (each aligned to :data:`_ALIGN`), and the total."""
    offs, n = [], 0
    for t in ts:
        offs.append(n)
        n += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return offs, n


def _in_stash(t: torch.Tensor, stash: HostStash | None) -> bool:
    if stash is None or t.device.type != "cpu" or not stash.nbytes:
        return False
    lo = stash.buf.data_ptr()
    return lo <= t.data_ptr() < lo + stash.nbytes


def stash_tensors(engine) -> int:
    """Copy every tensor of the engine that is not in its host stash yet into the stash (one
    flat buffer, :class:`HostStash`) and put the stash's views in their places; returns the bytes
    copied. What :func:`offload` does on an accelerator; on a CPU engine it is a host copy
    (the CPU tests exercise the moves this way)."""
    stash: HostStash | None = getattr(engine, "_host_stash", None)
    every = engine_slots(engine)
    slots = [s for s in every if not _in_stash(s.get(), stash)]
    if not slots:
        return 0
    if len(slots) < len(every):  # cannot happen: moves are all or nothing, and a wake comes first
        raise RuntimeError("the trainer engine is partly in its host stash; wake it before it sleeps again")
    ts = [s.get() for s in slots]
    offs, total = _layout(ts)
    if stash is None or stash.nbytes < total:
        if stash is not None:
            stash.release()
        stash = engine._host_stash = HostStash(total, engine.device)
    views = []
    for t, off in zip(ts, offs):
        v = stash.buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        v.copy_(t, non_blocking=stash.registered)
        views.append(v)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    for s, v in zip(slots, views):
        s.put(v)
    return sum(t.numel() * t.element_size() for t in ts)


def unstash_tensors(engine, device: torch.device) -> int:
    """Copy every tensor of the engine that is in its host stash to fresh tensors on ``device``
    and put them in their places; returns the bytes copied. The stash is kept for the next sleep.

    Raises:
        torch.cuda.OutOfMemoryError: too little free device memory; nothing was moved (the
            engine stays in host memory, which stays valid; calling again retries).
    """
    stash: HostStash | None = getattr(engine, "_host_stash", None)
    slots = [s for s in engine_slots(engine) if _in_stash(s.get(), stash)]
    ts = [s.get() for s in slots]
    fresh = []
    for t in ts:
        d = torch.empty_like(t, device=device)
        d.copy_(t, non_blocking=stash.registered)
        fresh.append(d)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for s, d in zip(slots, fresh):
        s.put(d)
    return sum(t.numel() * t.element_size() for t in ts)


def offload(engine) -> int:
    """Move the engine's tensors to host memory (idle sleep); returns the device bytes freed.

    Call it between engine computations (the trainer function holds its engine lock). On a CPU
    engine it moves nothing and returns 0.
    """
    if engine.device.type == "cpu":
        return 0
    freed = stash_tensors(engine)
    torch.cuda.empty_cache()
    return freed


def reload(engine) -> int:
    """Move the engine's tensors back to its device (wake); returns the bytes moved (0 on a CPU
    engine). Raises as :func:`unstash_tensors`."""
    if engine.device.type == "cpu":
        return 0
    return unstash_tensors(engine, engine.device)
