"""Sampler backends and the factory that picks one.

``hf`` (:mod:`functions.sampler.backends.hf`): transformers with its own continuous batching,
CPU or one GPU. ``vllm`` (:mod:`functions.sampler.backends.vllm`): vLLM's ``AsyncLLM`` on a
GPU, inside a :class:`functions.sampler.backends.routed.RoutedBackend` that sends the jobs vLLM
cannot serve exactly to a transformers backend started on first need. Both implement :class:`functions.sampler.types.SamplerBackend` and import only the
sampler's types (never the engine); they are imported lazily here, so importing this package
pulls in neither transformers nor vLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import torch

from functions.sampler.types import SamplerBackend

#: Module of the vLLM backend (imported only when chosen).
VLLM_MODULE = "functions.sampler.backends.vllm"


def make_backend(
    kind: str,
    base_model_dir: Path,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_batch_rows: int | None = None,
    max_context: int | None = None,
    deterministic: bool = False,
) -> SamplerBackend:
    """Build a backend by name.

    Args:
        kind: ``"hf"`` (:mod:`functions.sampler.backends.hf`), ``"vllm"`` (module
            ``functions.sampler.backends.vllm``, class ``VLLMBackend``, same keyword
            arguments, wrapped in a ``RoutedBackend`` with a transformers backend for what
            vLLM cannot do), or ``"auto"``: vLLM when a CUDA device is present and ``vllm``
            is importable, else transformers.
        base_model_dir: local Hugging Face model directory (config, safetensors, tokenizer).
        max_batch_rows: most sequences decoded together; None = the backend's default
            (transformers 64; vLLM 256 or ``$OPENRL_SAMPLER_MAX_NUM_SEQS``, so that 128
            concurrent samples share one decode batch).
        deterministic: the deterministic mode (issue 33): transformers with every job
            decoded alone (:mod:`functions.sampler.backends.hf_solo`); ``"auto"`` then picks
            transformers (vLLM's batch-invariant mode is not wired in yet).

    Raises:
        ValueError: unknown ``kind``, or ``"vllm"`` in the deterministic mode.
    """
    if deterministic:
        if kind == "vllm":
            raise ValueError("the deterministic mode samples with the transformers backend for now: set "
                             "OPENRL_SAMPLER_BACKEND=hf (or auto), or turn the mode off for this model")
        kind = "hf"
    if kind == "auto":
        use_vllm = (
            device != "cpu"
            and torch.cuda.is_available()
            and importlib.util.find_spec("vllm") is not None
            and importlib.util.find_spec(VLLM_MODULE) is not None
        )
        kind = "vllm" if use_vllm else "hf"
    kwargs = dict(device=device, dtype=dtype, max_context=max_context)
    if max_batch_rows is not None:
        kwargs["max_batch_rows"] = max_batch_rows
    if kind == "hf":
        from functions.sampler.backends.hf import HFBackend

        return HFBackend(base_model_dir, deterministic=deterministic, **kwargs)
    if kind == "vllm":
        from functions.sampler.backends.routed import RoutedBackend

        mod = importlib.import_module(VLLM_MODULE)
        primary = mod.VLLMBackend(base_model_dir, **kwargs)

        def make_hf():
            from functions.sampler.backends.hf import HFBackend

            return HFBackend(base_model_dir, device=device, dtype=dtype, max_context=primary.limits.max_context)

        return RoutedBackend(primary, make_hf)
    raise ValueError(f"unknown sampler backend {kind!r} (expected 'auto', 'hf' or 'vllm')")


__all__ = ["VLLM_MODULE", "make_backend"]
