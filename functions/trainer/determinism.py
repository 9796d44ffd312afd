"""The trainer's deterministic mode (issue 33): packing never changes a run's numbers.

In the mode (``Settings.deterministic`` / ``openrl serve --deterministic``, or a registry
entry's ``deterministic``; passed to :class:`functions.trainer.engine.TrainerEngine` as its
``deterministic`` argument) the engine is batch-invariant *by construction*:

* every row (datum) runs in its own micro-batch (:func:`plan_rows`): input ids ``[1, T]`` with
  no padding from other rows, so every kernel of the forward, the vocabulary projection and
  the backward sees shapes that depend only on that row and its run's adapter;
* micro-batches run in the pass's row order (request order, then datum order), so each run's
  gradients accumulate (``p.grad += ...``) in the run's own row order and its ``loss:sum`` is
  summed in its own datum order, whatever other runs share the pass;
* the vocabulary projection takes the checkpointed path both with and without a gradient
  (``fused_head`` off), so a forward and a forward_backward compute the same logprobs with the
  same code;
* the optimizer already is per element (``torch._foreach_*`` over all runs' tensors, the
  global norm per run): nothing to change.

:func:`configure` (:mod:`openrl.model.determinism`, shared with the sampler) sets the
process-wide switches: ``torch.use_deterministic_algorithms(True)``
and, before CUDA initialises, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``; on CUDA it also picks the
eager attention (whose backward has no atomics) and the engine leaves out Liger's fused
kernels. The CUDA half cannot be checked on CPU: the GPU conformance run
(issue 33, item 4) checks it bitwise.

The cost: one forward (and backward) per datum instead of one per packed micro-batch.
"""

from __future__ import annotations

from typing import Sequence

from functions.trainer.rows import Row
from openrl.model.determinism import CUBLAS_WORKSPACE, configure


def plan_rows(rows: Sequence[Row]) -> list[list[Row]]:
    """The mode's micro-batch plan: one row per micro-batch, in the order given (the pass's
    request order, then datum order). Pure; ignores the token caps (a row longer than the
    engine's ``max_tokens`` ran alone anyway)."""
    return [[r] for r in rows]


__all__ = ["CUBLAS_WORKSPACE", "configure", "plan_rows"]
