"""The deterministic mode's process-wide switches (issue 33), shared by the trainer engine
(:mod:`functions.trainer.determinism`) and the transformers sampler backend
(:mod:`functions.sampler.backends.hf_solo`): both processes run the same kernels, so a
sequence the sampler scores in the mode gets the trainer's bits.
"""

from __future__ import annotations

import logging
import os

import torch

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


__all__ = ["CUBLAS_WORKSPACE", "configure"]
