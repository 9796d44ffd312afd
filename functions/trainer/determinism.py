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

:func:`configure` sets the process-wide switches: ``torch.use_deterministic_algorithms(True)``
and, before CUDA initialises, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``; on CUDA it also picks the
eager attention (whose backward has no atomics) and the engine leaves out Liger's fused
kernels. The CUDA half cannot be checked on CPU: the GPU conformance run
(issue 33, item 4) checks it bitwise.

The cost: one forward (and backward) per datum instead of one per packed micro-batch.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

from functions.trainer.rows import Row

log = logging.getLogger(__name__)

#: cuBLAS workspace setting that makes its GEMMs deterministic (must be set before CUDA starts).
CUBLAS_WORKSPACE = ":4096:8"


def configure(base: torch.nn.Module, device: torch.device) -> None:
    """Switch torch to deterministic algorithms for the mode, and on CUDA the model's
    attention to the eager implementation.

    Args:
        base: the Hugging Face causal LM (its ``config._attn_implementation`` is set on CUDA).
        device: where the engine runs.

    Side effects: process-wide ``torch.use_deterministic_algorithms(True)`` (an op without a
    deterministic implementation then raises ``RuntimeError`` when it runs);
    ``CUBLAS_WORKSPACE_CONFIG`` is set unless already set (it only takes effect when set before
    the first cuBLAS call of the process: the GPU conformance run checks the result).
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    if device.type == "cuda":  # unchecked here; the GPU conformance run checks it
        if hasattr(base, "set_attn_implementation"):
            base.set_attn_implementation("eager")
        else:
            base.config._attn_implementation = "eager"
        log.info("deterministic mode: eager attention, deterministic algorithms, cuBLAS workspace %s",
                 os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def plan_rows(rows: Sequence[Row]) -> list[list[Row]]:
    """The mode's micro-batch plan: one row per micro-batch, in the order given (the pass's
    request order, then datum order). Pure; ignores the token caps (a row longer than the
    engine's ``max_tokens`` ran alone anyway)."""
    return [[r] for r in rows]


__all__ = ["CUBLAS_WORKSPACE", "configure", "plan_rows"]
