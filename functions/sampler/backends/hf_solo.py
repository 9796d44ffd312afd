"""The transformers backend's deterministic mode (issue 33): every job decodes alone.

In the mode (:class:`functions.sampler.backends.hf.HFBackend` built with
``deterministic=True``) a request's tokens and logprobs do not depend on the other requests
the backend is serving: each job's prompt is prefilled in its own forward (input ids
``[1, P]``, no padding), the job's rows then keep their own KV cache (a
:class:`~functions.sampler.backends.hf_batch.RunningBatch` of that job's rows only; they all
hold ``P + t`` tokens at step t, so it has no padding columns) and decode together in the job's
own forward (input ids ``[n, 1]``, n = the job's rows still running), and each token is drawn
from its row's logits alone. What enters a job's forward (its prompt, adapter, the rows still
running, which depends on its own draws only) is the job's own, so the shapes its kernels see,
and their bits, are the same alone or among any others. A seeded row's generator is seeded from
``(seed, sample index)`` as outside the mode, so a seeded request gives the same tokens and
logprobs alone or among any others, and across calls (the same request: its ``num_samples``
is part of it).

The logprobs a finished sequence reports are those the trainer computes for it
(:func:`rescore`): the trainer in the mode runs each datum alone (input ids ``[1, T]``, no
padding) through :func:`openrl.model.logprobs.target_logprobs` with the checkpointed
vocabulary projection, so the sampler runs that same function on the datum an RL loop builds
from the sample (``prompt + tokens[:-1]`` in, ``prompt[1:] + tokens`` as targets) with the same
adapter weights (float32 in both processes) and the same process-wide switches
(:func:`openrl.model.determinism.configure`): the same shapes through the same kernels give the
trainer's bits, so ``kl_sample_train`` is exactly 0. The tokens themselves are drawn from the
decode step's logits (a KV-cached ``[n, 1]`` forward); those can differ from the rescored ones in
the last bits, which moves a draw only when the uniform lands within that difference of a CDF
boundary. ``topk`` sample logprobs stay the decode step's.

The cost: one decoder forward per running job per step instead of one per step (the
transformers backend is launch-bound on a GPU, about 0.1 s per forward of a 36-layer model, so
a step costs about that per job), and one more forward of ``prompt + tokens`` per finished
sequence. Each adapter's compute-dtype cast is made once per step
(:meth:`openrl.model.lora.MultiLoRAModel.pass_weights`; the same values as a cast per layer
call). Touched only by the backend's worker thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from openrl.model.logprobs import target_logprobs

if TYPE_CHECKING:
    from functions.sampler.backends.hf import HFBackend


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
    """The mode's iteration of ``HFBackend._step``: drop cancelled jobs, prefill each admitted
    job alone (its rows, one batch with no padding, join ``backend._solos`` through
    ``HFBackend._merge``), then decode one
    token for every running row, one forward per job (its running rows, ``[n, 1]``). Each
    adapter's compute-dtype cast is made once for the step.

    Returns:
        (jobs completed in this step, rows still running).
    """
    done: list[Any] = []
    if cancelled:
        backend._solos = [s for s in backend._solos if s.rows[0].job not in cancelled]
    with backend.model.pass_weights():
        for j in admit:
            backend._prefill([j], done)
        running = []
        for b in backend._solos:
            n = len(b.rows)
            mask = torch.cat([b.mask, torch.ones((n, 1), dtype=b.mask.dtype)], dim=1)
            with backend.model.use_adapters([b.rows[0].job.job.model_path] * n):
                hidden, b.cache = backend._forward(b.next_tok[:, None], mask, b.pos[:, None], b.cache)
                backend.steps += 1
                logits = backend._logits(hidden[:, -1])  # [n, V]
            b.mask = mask
            b.pos = b.pos + 1
            toks, finished = backend._process(b.rows, logits, done)
            b.next_tok = toks
            keep = [i for i, f in enumerate(finished) if not f]
            if keep:
                if len(keep) < n:  # the job's finished rows leave its batch (its own draws decided it)
                    b.keep(keep, backend.device)
                running.append(b)
    backend._solos = running
    return done, sum(len(b.rows) for b in running)


__all__ = ["rescore", "step"]
