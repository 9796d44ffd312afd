"""Where a trainer engine's tensors live: on its device, or in host memory while the worker sleeps.

Idle sleep (:mod:`openrl.transport.bindings.idle_sleep`) moves everything a
:class:`~functions.trainer.engine.TrainerEngine` holds on its accelerator to host memory and
back: the frozen base weights and buffers, every run's LoRA parameters and their accumulated
gradients (``Module.to``, which keeps each ``Parameter`` object, so the optimizers' references
stay valid), and every run's AdamW moments (``exp_avg``, ``exp_avg_sq``; the ``step`` counts
already live on the host). Nothing is dropped, and no value changes: a tensor moved to the
host and back is bit for bit the same. Then the CUDA caching allocator's free blocks are
returned to the driver, so the memory is free to other processes (the sampler's vLLM).
"""

from __future__ import annotations

import torch


def _state_tensors(engine) -> list[tuple[dict, str]]:
    """``(state dict, key)`` of every optimizer-state tensor of every run (not ``step``)."""
    out = []
    for run in engine.runs.values():
        for st in run.optimizer.opt.state.values():
            out.extend((st, k) for k, v in st.items() if torch.is_tensor(v) and k != "step")
    return out


def resident_bytes(engine) -> int:
    """Bytes of the engine's parameters, gradients, buffers and optimizer moments on its device
    (0 when they are in host memory, or the device is the CPU)."""
    if engine.device.type == "cpu":
        return 0
    ts = [p for p in engine.model.parameters()] + [p.grad for p in engine.model.parameters() if p.grad is not None]
    ts += list(engine.model.buffers()) + [st[k] for st, k in _state_tensors(engine)]
    return sum(t.numel() * t.element_size() for t in ts if t.device.type == engine.device.type)


def move_engine(engine, device: torch.device | str) -> int:
    """Move every tensor the engine holds (see the module doc) to ``device``; returns the bytes
    that were on the engine's device before (what a move to the host frees there).

    Call it between engine computations (the trainer function holds its engine lock). On a CPU
    engine it moves nothing and returns 0.

    Raises:
        torch.cuda.OutOfMemoryError: moving back found too little free device memory (the
            tensors that did not move yet stay in host memory; moving again resumes).
    """
    if engine.device.type == "cpu":
        return 0
    before = resident_bytes(engine)
    device = torch.device(device)
    engine.model.to(device)
    for st, k in _state_tensors(engine):
        st[k] = st[k].to(device)
    if device.type == "cpu":
        torch.cuda.synchronize(engine.device)
        torch.cuda.empty_cache()
    return before


def offload(engine) -> int:
    """Move the engine to host memory (idle sleep); returns the device bytes freed."""
    return move_engine(engine, "cpu")


def reload(engine) -> int:
    """Move the engine back to its device (wake); returns 0 (nothing was on the device)."""
    return move_engine(engine, engine.device)
