"""The sampler's engine: request validation, an adapter LRU cache, and a pluggable backend.

Layers::

    functions/sampler.Function.handle(event)        (decodes /asample, fetches weights)
        └─ SamplerEngine.sample(job)                 validation, omitted max_tokens, adapter pinning
               └─ SamplerBackend.sample(job)          batching + decoding (backends/: transformers
                                                      on CPU or GPU, vLLM on GPU)

Everything is asynchronous and safe for many concurrent callers on one event loop: each
``sample`` call is one request; the backend batches concurrent requests together (the
transformers backend decodes all pending rows in one forward per step; vLLM does its own
continuous batching).

The job / result types and the backend protocol live in ``functions.sampler.types`` (with
the numerics contract every backend honours), the backends and their factory in
``functions.sampler.backends``; both are re-exported here.

Adapters are keyed by an immutable snapshot key (the ``tinker://`` sampler-weights path): a
key always means the same weights, so a loaded adapter never has to be reloaded.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import torch

from functions.sampler.backends import make_backend
from functions.sampler.types import (
    TOPK_MASK_LOGPROB,
    ModelLimits,
    SampledSequence,
    SampleJob,
    SampleResult,
    SamplerBackend,
    TopK,
)
from openrl.contract.sample_limits import check_sample_size
from openrl.errors import ServerError, UserError

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- engine


class SamplerEngine:
    """Validates sampling jobs, keeps an LRU cache of adapters, and runs jobs on a backend.

    Args:
        base_model_dir: local HF directory of the base model.
        device: torch device for the transformers backend (``"cpu"``, ``"cuda"``).
        dtype: model dtype (float32 on CPU); logprobs are float32 regardless.
        max_batch_rows: most sequences decoded together in one forward; None = the
            backend's default (transformers 64, vLLM 256: see :func:`make_backend`).
        adapter_cache_size: adapters kept loaded; the least recently used one not in use is
            unloaded beyond this (an adapter pinned by a running job is never unloaded, so
            the cache can briefly exceed the size).
        max_tokens_default: cap on ``max_tokens`` when a job gives None; None (default) = no
            cap: such a job generates until a stop or the end of the context (``max_context -
            len(prompt)`` tokens). The gateway already replaces an omitted ``max_tokens`` by
            ``min(OPENRL_SAMPLER_MAX_TOKENS_CAP, context - prompt)``; this is for direct use.
        max_context: cap on prompt + generated tokens; default: the model's
            ``max_position_embeddings``.
        max_num_samples: most sequences per job.
        max_topk: most top-K width for ``topk_*_logprobs`` and ``prompt_alt_tokens_k``.
        backend: ``"auto"`` | ``"hf"`` | ``"vllm"`` or a ready ``SamplerBackend``.
    """

    def __init__(
        self,
        base_model_dir: Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_rows: int | None = None,
        adapter_cache_size: int = 8,
        max_tokens_default: int | None = None,
        max_context: int | None = None,
        max_num_samples: int = 128,
        max_topk: int = 20,
        backend: str | SamplerBackend = "auto",
    ):
        if isinstance(backend, str):
            backend = make_backend(
                backend,
                Path(base_model_dir),
                device=device,
                dtype=dtype,
                max_batch_rows=max_batch_rows,
                max_context=max_context,
            )
        self.backend: SamplerBackend = backend
        self.limits: ModelLimits = backend.limits
        self.adapter_cache_size = max(1, int(adapter_cache_size))
        self.max_tokens_default = None if max_tokens_default is None else int(max_tokens_default)
        self.max_num_samples = int(max_num_samples)
        self.max_topk = int(max_topk)
        self._adapters: OrderedDict[str, Path] = OrderedDict()  # key -> dir, LRU first
        self._in_use: dict[str, int] = {}  # key -> running jobs pinning it
        self._loading: dict[str, asyncio.Future] = {}
        self._closed = False

    # -- adapters

    def loaded_adapters(self) -> list[str]:
        """Keys of loaded adapters, least recently used first."""
        return list(self._adapters)

    async def ensure_adapter(self, key: str, local_dir: Path) -> None:
        """Make adapter ``key`` (a PEFT directory at ``local_dir``) loaded and most recently used.

        Loads it if needed (concurrent calls for the same key load it once), then unloads
        least-recently-used adapters beyond ``adapter_cache_size`` that no job is using.

        Raises:
            UserError: the directory is not a usable PEFT adapter for this base model.
        """
        from openrl.observe import metrics

        if key in self._adapters:
            self._adapters.move_to_end(key)
            metrics.ADAPTER_CACHE.labels("hit").inc()
            return
        pending = self._loading.get(key)
        if pending is not None:
            await asyncio.shield(pending)
            if key in self._adapters:
                self._adapters.move_to_end(key)
                metrics.ADAPTER_CACHE.labels("hit").inc()  # loaded by a concurrent caller
                return
        metrics.ADAPTER_CACHE.labels("miss").inc()
        fut = asyncio.get_running_loop().create_future()
        self._loading[key] = fut
        try:
            t0 = time.perf_counter()
            await self.backend.load_adapter(key, Path(local_dir))
            metrics.ADAPTER_LOAD_SECONDS.observe(time.perf_counter() - t0)
            self._adapters[key] = Path(local_dir)
        finally:
            del self._loading[key]
            fut.set_result(None)
        await self._evict(protect=key)

    async def _evict(self, protect: str | None = None) -> None:
        """Unload LRU adapters beyond the cache size, skipping pinned ones and ``protect``
        (the adapter just ensured, which its caller is about to use)."""
        while len(self._adapters) > self.adapter_cache_size:
            victim = next((k for k in self._adapters if not self._in_use.get(k) and k != protect), None)
            if victim is None:  # everything is pinned; evict when a job releases one
                return
            del self._adapters[victim]
            log.info("unloading adapter %s (LRU)", victim)
            await self.backend.unload_adapter(victim)

    # -- validation

    def validate(self, job: SampleJob) -> SampleJob:
        """Check ``job`` against the model and the limits; return it with ``max_tokens`` set
        (None becomes the room left in the context, capped at ``max_tokens_default``).

        Raises:
            UserError: naming the field at fault (``prompt.chunks``, ``num_samples``,
                ``sampling_params.max_tokens|temperature|top_p|top_k|seed|stop``,
                ``topk_prompt_logprobs``, ``topk_sample_logprobs``,
                ``prompt_logprobs_last_n``, ``target_prompt_logprobs``,
                ``prompt_alt_tokens_k``).
        """
        lim = self.limits
        prompt = job.prompt
        # the gateway runs the same check before it publishes (openrl/contract/sample_limits.py)
        max_tokens = check_sample_size(prompt, job.num_samples, job.max_tokens, vocab_size=lim.vocab_size,
                                       max_context=lim.max_context, max_num_samples=self.max_num_samples,
                                       default_max_tokens=self.max_tokens_default, prompt_field="prompt.chunks")
        P = len(prompt)
        if not _is_real(job.temperature) or job.temperature < 0:
            raise UserError("sampling_params.temperature", f"must be a finite number >= 0, got {job.temperature!r}")
        if not _is_real(job.top_p) or not 0 < job.top_p <= 1:
            raise UserError("sampling_params.top_p", f"must be in (0, 1], got {job.top_p!r}")
        if not _is_int(job.top_k) or job.top_k < -1:
            raise UserError("sampling_params.top_k", f"must be -1 (no limit) or a positive integer, got {job.top_k!r}")
        if job.seed is not None and not _is_int(job.seed):
            raise UserError("sampling_params.seed", f"must be an integer, got {job.seed!r}")
        stop = job.stop
        if stop is not None:
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, (list, tuple)):
                raise UserError("sampling_params.stop", "must be a string, a list of strings or a list of token ids")
            stop = list(stop)
            if all(isinstance(s, str) for s in stop):
                if any(s == "" for s in stop):
                    raise UserError("sampling_params.stop", "stop strings must not be empty")
                if stop and not lim.has_tokenizer:
                    raise UserError("sampling_params.stop", "this model has no tokenizer; use stop token ids")
            elif all(_is_int(s) for s in stop):
                bad = [s for s in stop if not 0 <= s < lim.vocab_size]
                if bad:
                    raise UserError(
                        "sampling_params.stop", f"stop token id {bad[0]} is outside the vocabulary [0, {lim.vocab_size})"
                    )
            else:
                raise UserError("sampling_params.stop", "must be all strings or all token ids, not a mix")
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            k = getattr(job, name)
            if not _is_int(k) or not 0 <= k <= self.max_topk:
                raise UserError(name, f"must be an integer in [0, {self.max_topk}], got {k!r}")
        n = job.prompt_logprobs_last_n
        if n is not None:
            if not _is_int(n) or not 1 <= n <= P - 1:
                raise UserError(
                    "prompt_logprobs_last_n", f"must be an integer in [1, len(prompt) - 1 = {P - 1}], got {n!r}"
                )
            if not job.prompt_logprobs:
                raise UserError("prompt_logprobs_last_n", "needs prompt_logprobs (include_prompt_logprobs) set")
        tgt = job.target_prompt_ids
        if tgt is not None:
            if len(tgt) != P - 1 or any(not isinstance(r, (list, tuple)) for r in tgt):
                raise UserError("target_prompt_logprobs", f"must have exactly len(prompt) - 1 = {P - 1} rows")
            width = {len(r) for r in tgt}
            if len(width) > 1:
                raise UserError("target_prompt_logprobs", "rows must all have the same width")
            ids = [t for r in tgt for t in r]
            if not any(t != -1 for t in ids):
                raise UserError("target_prompt_logprobs", "must name at least one token id")
            if any(not _is_int(t) or not -1 <= t < lim.vocab_size for t in ids):
                raise UserError("target_prompt_logprobs", f"ids must be -1 or in [0, {lim.vocab_size})")
            if width and next(iter(width)) > self.max_topk:
                raise UserError("target_prompt_logprobs", f"at most {self.max_topk} ids per row")
        if job.adapter is not None and not isinstance(job.adapter, str):
            raise UserError("model_path", "adapter key must be a string")
        return replace(job, prompt=list(prompt), max_tokens=max_tokens, stop=stop)

    # -- sampling

    async def sample(self, job: SampleJob, *, adapter_dir: Path | None = None) -> SampleResult:
        """Validate and run one job; many callers may await this concurrently.

        Args:
            job: the request. ``job.adapter`` must be loaded already, or ``adapter_dir``
                given (then it is loaded here, atomically with pinning it).
            adapter_dir: local PEFT directory of ``job.adapter``.

        Returns:
            ``SampleResult`` with ``job.num_samples`` sequences.

        Raises:
            UserError: invalid job (see ``validate``).
            ServerError: ``job.adapter`` is not loaded and no ``adapter_dir`` was given, or
                the engine is closed.
        """
        if self._closed:
            raise ServerError("the sampler engine is closed")
        job = self.validate(job)
        key = job.adapter
        if key is None:
            return await self.backend.sample(job)
        self._in_use[key] = self._in_use.get(key, 0) + 1
        try:
            if adapter_dir is not None:
                await self.ensure_adapter(key, adapter_dir)
            elif key not in self._adapters:
                raise ServerError(f"adapter {key!r} is not loaded (call ensure_adapter first)")
            else:
                self._adapters.move_to_end(key)
            return await self.backend.sample(job)
        finally:
            self._in_use[key] -= 1
            if not self._in_use[key]:
                del self._in_use[key]
                if len(self._adapters) > self.adapter_cache_size:
                    await self._evict()

    async def sleep(self) -> bool:
        """Idle sleep of the backend (its weights and loaded adapters to host memory); False when
        it declined (jobs still running).

        Raises:
            ServerError: the backend cannot sleep.
        """
        if self._in_use:
            return False
        fn = getattr(self.backend, "sleep", None)
        if not callable(fn):
            raise ServerError(f"the {getattr(self.backend, 'name', type(self.backend).__name__)} sampler backend "
                              "cannot sleep")
        return await fn() is not False

    async def wake(self) -> None:
        """Wake the backend (loaded adapters stay loaded)."""
        await self.backend.wake()

    async def close(self) -> None:
        """Stop the backend; jobs still running fail with ``ServerError``."""
        self._closed = True
        await self.backend.close()


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


__all__ = [
    "TOPK_MASK_LOGPROB",
    "ModelLimits",
    "SampleJob",
    "SampleResult",
    "SampledSequence",
    "SamplerBackend",
    "SamplerEngine",
    "TopK",
    "make_backend",
]
