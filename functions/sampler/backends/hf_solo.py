"""The transformers backend's deterministic mode (issue 33): every sequence decodes alone.

In the mode (:class:`functions.sampler.backends.hf.HFBackend` built with
``deterministic=True``) a request's tokens and logprobs do not depend on the other requests
the backend is serving: each job's prompt is prefilled in its own forward (input ids
``[1, P]``, no padding), each of its rows then keeps its own KV cache (a
:class:`~functions.sampler.backends.hf_batch.RunningBatch` of one row, no padding columns)
and decodes in its own forward (``[1, 1]``), and its token is drawn and its logprob computed
from that row's logits alone. A seeded row's generator is seeded from ``(seed, sample index)``
as outside the mode, so a seeded request gives the same tokens and logprobs alone or among any
others, and across calls. The cost: one decoder forward per running sequence per step
instead of one per step. Touched only by the backend's worker thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from functions.sampler.backends.hf_batch import RunningBatch

if TYPE_CHECKING:
    from functions.sampler.backends.hf import HFBackend


def split_rows(batch: RunningBatch) -> list[RunningBatch]:
    """``batch``'s rows as batches of one row each, in order, each with its own cache
    (copies of the row's keys / values, its all-padding columns dropped)."""
    from transformers import DynamicCache

    out = []
    for r, row in enumerate(batch.rows):
        real = batch.mask[r].nonzero()
        c = int(real[0]) if real.numel() else 0
        one = RunningBatch()
        one.rows = [row]
        one.cache = DynamicCache(ddp_cache_data=[(layer.keys[r: r + 1, :, c:], layer.values[r: r + 1, :, c:])
                                                 for layer in batch.cache.layers])
        one.mask = batch.mask[r: r + 1, c:].clone()
        one.next_tok = batch.next_tok[r: r + 1].clone()
        one.pos = batch.pos[r: r + 1].clone()
        out.append(one)
    return out


def step(backend: "HFBackend", admit: list[Any], cancelled: set[Any]) -> tuple[list[Any], int]:
    """The mode's iteration of ``HFBackend._step``: drop cancelled rows, prefill each admitted
    job alone (its rows join ``backend._solos`` through ``HFBackend._merge``), then decode one
    token for every running row, one forward per row.

    Returns:
        (jobs completed in this step, rows still running).
    """
    done: list[Any] = []
    if cancelled:
        backend._solos = [s for s in backend._solos if s.rows[0].job not in cancelled]
    for j in admit:
        backend._prefill([j], done)
    running = []
    for b in backend._solos:
        mask = torch.cat([b.mask, torch.ones((1, 1), dtype=b.mask.dtype)], dim=1)
        with backend.model.use_adapters([b.rows[0].job.job.model_path]):
            hidden, b.cache = backend._forward(b.next_tok[:, None], mask, b.pos[:, None], b.cache)
            backend.steps += 1
            logits = backend._logits(hidden[:, -1])  # [1, V]
        b.mask = mask
        b.pos = b.pos + 1
        toks, finished = backend._process(b.rows, logits, done)
        b.next_tok = toks
        if not finished[0]:
            running.append(b)
    backend._solos = running
    return done, len(running)


__all__ = ["split_rows", "step"]
