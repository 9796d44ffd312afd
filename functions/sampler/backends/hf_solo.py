"""The transformers backend's deterministic mode (issue 33): every sequence decodes alone.

In the mode (:class:`functions.sampler.backends.hf.HFBackend` built with
``deterministic=True``) a request's tokens and logprobs do not depend on the other requests
the backend is serving: each job's prompt is prefilled in its own forward (input ids
``[1, P]``, no padding), each of its rows then keeps its own KV cache (a
:class:`~functions.sampler.backends.hf_batch.RunningBatch` of one row, no padding columns)
and decodes in its own forward (``[1, 1]``), and its token is drawn from that row's logits
alone. A seeded row's generator is seeded from ``(seed, sample index)`` as outside the mode,
so a seeded request gives the same tokens and logprobs alone or among any others, and across
calls.

The logprobs a finished sequence reports are those the trainer computes for it
(:func:`rescore`): the trainer in the mode runs each datum alone (input ids ``[1, T]``, no
padding) through :func:`openrl.model.logprobs.target_logprobs` with the checkpointed
vocabulary projection, so the sampler runs that same function on the datum an RL loop builds
from the sample (``prompt + tokens[:-1]`` in, ``prompt[1:] + tokens`` as targets) with the same
adapter weights (float32 in both processes) and the same process-wide switches
(:func:`openrl.model.determinism.configure`): the same shapes through the same kernels give the
trainer's bits, so ``kl_sample_train`` is exactly 0. The tokens themselves are drawn from the
decode step's logits (a KV-cached ``[1, 1]`` forward); those can differ from the rescored ones in
the last bits, which moves a draw only when the uniform lands within that difference of a CDF
boundary. ``topk`` sample logprobs stay the decode step's.

The cost: one decoder forward per running sequence per step instead of one per step, and one
more forward of ``prompt + tokens`` per finished sequence. Touched only by the backend's
worker thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from functions.sampler.backends.hf_batch import RunningBatch
from openrl.model.logprobs import target_logprobs

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


def rescore(backend: "HFBackend", row: Any) -> list[float]:
    """The logprobs of ``row``'s sampled tokens as the trainer computes them in the mode.

    Args:
        backend: the mode's backend (its ``model`` holds the row's adapter).
        row: a finished ``hf._Row`` (``tokens``: N >= 1 sampled ids; its job's prompt has P >= 1).

    Returns:
        N float32 values (as Python floats): ``log p(tokens[i] | prompt + tokens[:i])`` from one
        forward (not counted in ``backend.steps``) of ``prompt + tokens[:-1]`` (int64
        ``[1, P + N - 1]``, adapter ``model_path``) through
        :func:`openrl.model.logprobs.target_logprobs` with ``fused_head=False``: what the trainer's
        forward / forward_backward returns at positions ``P - 1 ...`` of that datum. Call under
        ``torch.no_grad()`` (the worker's step is).
    """
    prompt = list(row.job.job.prompt_tokens)
    seq = prompt + list(row.tokens)
    ids = torch.tensor([seq[:-1]], dtype=torch.long)
    tgt = torch.tensor([seq[1:]], dtype=torch.long)
    lp = target_logprobs(backend.model, ids, tgt, None, [row.job.job.model_path], fused_head=False)
    return lp[0, len(prompt) - 1:].tolist()


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


__all__ = ["rescore", "split_rows", "step"]
