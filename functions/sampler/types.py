"""The sampler's types: a job's result, the model limits a backend reports, and the
``SamplerBackend`` protocol. A leaf module: it imports nothing of the engine or backends.

The job itself is the ``sample`` event's payload, :class:`openrl.contract.payloads.Sample` (its
fields documented there): the engine validates it (``SamplerEngine.validate``: the field
constraints, then :func:`openrl.contract.sample_limits.check_sample_limits`) and hands backends a
copy whose ``sampling_params.max_tokens`` is an int and ``sampling_params.stop`` a list or None;
``model_path`` is the adapter key (None = the base model).

Numerics contract (all backends): every logprob returned (sampled tokens, prompt tokens,
top-k) is ``log_softmax`` of the model's raw logits in float32, at temperature 1 and with no
top-k/top-p filtering, i.e. ``openrl.model.logprobs.logprobs_from_logits``: the same numbers
the trainer's ``openrl.model.logprobs.target_logprobs`` gives for the same tokens.
Temperature, top-k and top-p change only *which* token is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from openrl.contract.payloads import Sample

#: Logprob written into empty top-k cells (Tinker's ``TopkLogprobs`` sentinel, with id 0).
TOPK_MASK_LOGPROB = -99999.0


# --------------------------------------------------------------------------- data types


#: Top-k logprobs at N positions: ``(ids [N][K], logprobs [N][K])``; empty cells are id 0
#: with logprob ``TOPK_MASK_LOGPROB`` (-99999.0), Tinker's ``TopkLogprobs`` convention.
TopK = tuple[list[list[int]], list[list[float]]]


@dataclass
class SampledSequence:
    """One generated sequence.

    Attributes:
        tokens: generated ids (prompt excluded), length N <= max_tokens; ends with the stop
            token / the token completing a stop string when ``stop_reason == "stop"``.
        logprobs: float32-computed logprob of each token in ``tokens`` (length N), under the
            raw model distribution (temperature 1, unfiltered).
        stop_reason: ``"stop"`` (stop token, stop string or EOS) or ``"length"`` (max_tokens).
        topk: top-K per generated position, ``([N][K] ids, [N][K] logprobs)``, when
            ``topk_sample_logprobs > 0``; else None.
    """

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    topk: TopK | None = None


@dataclass
class SampleResult:
    """The answer to one job (a :class:`~openrl.contract.payloads.Sample`).

    Attributes:
        sequences: ``num_samples`` sequences, in sample-index order.
        prompt_logprobs: P floats when ``prompt_logprobs``: entry ``t`` is log p(prompt[t] |
            prompt[:t]); entry 0 is NaN, and so is every entry before the last-N suffix.
        topk_prompt: ``([P][K] ids, [P][K] logprobs)`` when ``topk_prompt_logprobs > 0``;
            row 0 (and rows before the last-N suffix) empty.
        target_prompt_logprobs: ``[P-1][K]`` logprobs of ``target_prompt_ids`` (0.0 where
            the id was -1), when asked.
        prompt_alt_tokens: ``([P-1][k] ids, [P-1][k] logprobs)`` when ``prompt_alt_tokens_k``.
    """

    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None = None
    topk_prompt: TopK | None = None
    target_prompt_logprobs: list[list[float]] | None = None
    prompt_alt_tokens: TopK | None = None


# --------------------------------------------------------------------------- backend interface


@dataclass(frozen=True)
class ModelLimits:
    """What the engine needs to know about the loaded base model to validate requests.

    Attributes:
        vocab_size: valid token ids are ``0 <= id < vocab_size`` (the embedding rows).
        max_context: most tokens (prompt + generated) in one sequence.
        eos_token_ids: ids that end a sequence when ``stop`` is None or non-empty.
        has_tokenizer: whether stop *strings* can be honoured.
    """

    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]
    has_tokenizer: bool


@runtime_checkable
class SamplerBackend(Protocol):
    """A decoding backend for one base model. Implementations:
    ``functions.sampler.backends.hf.HFBackend`` (transformers, CPU or a single GPU) and
    ``functions.sampler.backends.vllm.VLLMBackend`` (vLLM, GPU); built by
    ``functions.sampler.backends.make_backend``.

    The engine calls ``sample`` only with validated jobs (``SamplerEngine.validate``) whose
    ``sampling_params.max_tokens`` is an int and whose adapter (``model_path``) is loaded and pinned (it is not unloaded before ``sample`` returns). A
    backend must honour the numerics contract in this module's docstring and the stop
    semantics in ``stops.py``.

    Attributes:
        limits: what the engine validates jobs against (vocabulary, context, EOS ids).
    """

    limits: ModelLimits

    async def load_adapter(self, key: str, directory: Path) -> None:
        """Load a PEFT LoRA directory (adapter_model.safetensors + adapter_config.json)
        under ``key``. Raises ``UserError("model_path", ...)`` if the files are unusable."""
        ...

    async def unload_adapter(self, key: str) -> None:
        """Free the adapter ``key`` (no job uses it)."""
        ...

    async def sample(self, job: Sample) -> SampleResult:
        """Run one validated job. Safe to call concurrently; batches concurrent calls."""
        ...

    async def close(self) -> None:
        """Stop background work and fail jobs still in flight."""
        ...


__all__ = [
    "TOPK_MASK_LOGPROB",
    "ModelLimits",
    "SampleResult",
    "SampledSequence",
    "SamplerBackend",
    "TopK",
]
