"""The sampler's types: a sampling job, its result, the model limits a backend reports, and
the ``SamplerBackend`` protocol. A leaf module: it imports nothing of the engine or backends.

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

#: Logprob written into empty top-k cells (Tinker's ``TopkLogprobs`` sentinel, with id 0).
TOPK_MASK_LOGPROB = -99999.0


# --------------------------------------------------------------------------- data types


@dataclass
class SampleJob:
    """One sampling request (one ``/asample``), already decoded from the wire.

    Attributes:
        prompt: prompt token ids (the ``encoded_text`` chunks concatenated), length P >= 1.
        num_samples: independent sequences to draw from the prompt (>= 1).
        max_tokens: most tokens to generate per sequence; None = until a stop or the room
            left in the context, capped by the engine's ``max_tokens_default`` when set (no
            hidden short default: the gateway sends ``min(OPENRL_SAMPLER_MAX_TOKENS_CAP,
            context - P)`` for a request that omits it).
        temperature: >= 0; 0 = greedy (argmax). Only changes which token is drawn.
        top_p: nucleus mass in (0, 1]; 1 = no nucleus filtering.
        top_k: keep the k most likely tokens; -1 (or 0) = no limit.
        seed: sequences ``i`` of a job with seed ``s`` are drawn from a generator seeded by
            ``(s, i)`` only, so the same seed gives the same samples whatever else is batched
            with it. None = a fresh random seed.
        stop: None = stop at EOS; ``[]`` = never stop (only ``max_tokens``); a list of token
            ids or a list of strings (a bare string counts as a one-element list) = stop at
            any of them or at EOS. See ``stops.py``: the
            returned tokens include the stop token / the token completing a stop string.
        prompt_logprobs: return ``SampleResult.prompt_logprobs``.
        topk_prompt_logprobs: K >= 0; return the top-K (id, logprob) at every prompt position.
        topk_sample_logprobs: K >= 0; return the top-K (id, logprob) at every sampled position.
        prompt_logprobs_last_n: score only the last N prompt positions (1 <= N <= P-1);
            earlier positions are NaN (prompt_logprobs) / empty (top-k rows). Needs
            ``prompt_logprobs``.
        adapter: key of an adapter loaded with ``SamplerEngine.ensure_adapter`` (or passed
            with ``adapter_dir`` to ``sample``); None = the base model.
        target_prompt_ids: optional ``[P-1][K]`` token ids (Tinker ``target_prompt_logprobs``):
            row ``i`` names ids to score at prompt position ``i+1``; -1 = unused cell.
        prompt_alt_tokens_k: k >= 0; draw k tokens at every prompt position after the first,
            at the job's temperature (Tinker ``prompt_alt_tokens_k``).
    """

    prompt: list[int]
    num_samples: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | list[int] | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    adapter: str | None = None
    target_prompt_ids: list[list[int]] | None = None
    prompt_alt_tokens_k: int = 0


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
    """The answer to one ``SampleJob``.

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

    The engine calls ``sample`` only with validated jobs whose ``max_tokens`` is an int and
    whose adapter is loaded and pinned (it is not unloaded before ``sample`` returns). A
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

    async def sample(self, job: SampleJob) -> SampleResult:
        """Run one validated job. Safe to call concurrently; batches concurrent calls."""
        ...

    async def close(self) -> None:
        """Stop background work and fail jobs still in flight."""
        ...


__all__ = [
    "TOPK_MASK_LOGPROB",
    "ModelLimits",
    "SampleJob",
    "SampleResult",
    "SampledSequence",
    "SamplerBackend",
    "TopK",
]
