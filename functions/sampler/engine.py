"""The sampler's engine: request validation, an adapter LRU cache, and a pluggable backend.

Layers::

    functions/sampler.Function.handle(event)        (parses the payload, fetches weights)
        └─ SamplerEngine.sample(job)                 validation, omitted max_tokens, adapter pinning
               └─ SamplerBackend.sample(job)          batching + decoding (backends/: transformers
                                                      on CPU or GPU, vLLM on GPU)

Everything is asynchronous and safe for many concurrent callers on one event loop: each
``sample`` call is one request; the backend batches concurrent requests together (the
transformers backend decodes all pending rows in one forward per step; vLLM does its own
continuous batching).

The job is the ``sample`` event's payload, :class:`openrl.contract.payloads.Sample`, from the
event to the backend (no other shape of a request). The result types and the backend protocol
live in ``functions.sampler.types`` (with the numerics contract every backend honours), the
backends and their factory in ``functions.sampler.backends``; both are re-exported here.

Adapters are keyed by an immutable snapshot key (the ``tinker://`` sampler-weights path): a
key always means the same weights, so a loaded adapter never has to be reloaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from pathlib import Path

import torch

from functions.sampler.backends import make_backend
from functions.sampler.types import (
    TOPK_MASK_LOGPROB,
    ModelLimits,
    SampledSequence,
    SampleResult,
    SamplerBackend,
    TopK,
)
from openrl.contract.payloads import Sample
from openrl.contract.sample_limits import check_sample_limits
from openrl.errors import ServerError

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
        deterministic: the deterministic mode (issue 33; :func:`make_backend`): a seeded job's
            tokens and logprobs do not depend on the other jobs. With a ready backend its own
            ``deterministic`` attribute counts.
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
        deterministic: bool = False,
    ):
        if isinstance(backend, str):
            backend = make_backend(
                backend,
                Path(base_model_dir),
                device=device,
                dtype=dtype,
                max_batch_rows=max_batch_rows,
                max_context=max_context,
                deterministic=deterministic,
            )
        self.backend: SamplerBackend = backend
        #: the deterministic mode (issue 33): the backend's own flag when it has one
        self.deterministic = bool(getattr(backend, "deterministic", deterministic))
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

    def validate(self, job: Sample) -> Sample:
        """Check ``job`` (its field constraints, again: a job built or changed in Python may break
        them; then the model and the limits, :func:`check_sample_limits`) and return a validated
        copy with the resolved values: ``sampling_params.max_tokens`` set (None becomes the room
        left in the context, capped at ``max_tokens_default``) and ``sampling_params.stop`` a list
        (or None).

        Raises:
            UserError: naming the field at fault (``prompt.chunks``, ``num_samples``,
                ``sampling_params.max_tokens|temperature|top_p|top_k|seed|stop``,
                ``topk_prompt_logprobs``, ``topk_sample_logprobs``,
                ``prompt_logprobs_last_n``, ``target_prompt_logprobs``,
                ``prompt_alt_tokens_k``, ``model_path``).
        """
        job = Sample.parse(job)
        lim = self.limits
        # the gateway runs the same size check before it publishes (openrl/contract/sample_limits.py)
        max_tokens = check_sample_limits(job, vocab_size=lim.vocab_size, max_context=lim.max_context,
                                         has_tokenizer=lim.has_tokenizer, max_num_samples=self.max_num_samples,
                                         max_topk=self.max_topk, default_max_tokens=self.max_tokens_default)
        sp = job.sampling_params
        return job.model_copy(update={"sampling_params": sp.model_copy(update={"max_tokens": max_tokens,
                                                                                "stop": sp.stop_list})})

    # -- sampling

    async def sample(self, job: Sample, *, adapter_dir: Path | None = None) -> SampleResult:
        """Validate and run one job; many callers may await this concurrently.

        Args:
            job: the request. Its ``model_path`` is the adapter key (None = the base model): it
                must be loaded already, or ``adapter_dir`` given (then it is loaded here,
                atomically with pinning it).
            adapter_dir: local PEFT directory of the adapter ``job.model_path``.

        Returns:
            ``SampleResult`` with ``job.num_samples`` sequences.

        Raises:
            UserError: invalid job (see ``validate``).
            ServerError: ``job.model_path`` is not loaded and no ``adapter_dir`` was given, or
                the engine is closed.
        """
        if self._closed:
            raise ServerError("the sampler engine is closed")
        job = self.validate(job)
        key = job.model_path
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


__all__ = [
    "TOPK_MASK_LOGPROB",
    "ModelLimits",
    "SampleResult",
    "SampledSequence",
    "SamplerBackend",
    "SamplerEngine",
    "TopK",
    "make_backend",
]
