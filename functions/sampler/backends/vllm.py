"""vLLM sampler backend: multi-LoRA continuous batching on a GPU, behind ``SamplerBackend``.

``functions.sampler.backends.make_backend("vllm", ...)`` (or ``"auto"`` when CUDA and
``vllm`` are present) builds a
:class:`VLLMBackend`: one ``vllm.v1.engine.async_llm.AsyncLLM`` per base model, whose engine
core (scheduler, paged KV cache, CUDA graphs, punica LoRA kernels) batches every request in
flight across all callers and adapters. Each ``sample`` call becomes one vLLM request (or
``num_samples`` requests when the job is seeded) awaited on the caller's event loop.

Adapters: ``load_adapter(key, dir)`` registers the PEFT directory under an integer LoRA id
(``AsyncLLM.add_lora``: read and validated now, so a bad adapter fails the load with a
``UserError`` rather than a later request); vLLM keeps up to ``max_loras`` of them in GPU
slots and ``max_cpu_loras`` in host memory, swapping by LRU. Keys are immutable snapshot
paths, so an id never needs reloading.

The unembedding (``lm_head``) LoRA that the trainer writes when ``train_unembed`` is on
(Tinker's default) is served whole: vLLM wraps the logits processor in
``LogitsProcessorWithLoRA`` (also on Qwen3's tied embeddings, where ``lm_head`` is the input
embedding module) and adds ``(h A^T) B^T * alpha / r`` to the logits, as the trainer does.
Because a vLLM that silently ignored that LoRA would sample a different policy than the one
trained (issue 22: 0.56 nats after 5 steps), the first adapter with an unembedding LoRA
triggers a check (:meth:`VLLMBackend._check_unembed`, :mod:`.unembed_check`): a probe copy of
the adapter whose lm_head LoRA moves chosen tokens by tens of nats must change the greedy
first token. If it does not (or the check fails), ``unembed_lora`` becomes ``"fallback"``: jobs
on such adapters go to the transformers backend
(:class:`functions.sampler.backends.routed.RoutedBackend`), which applies it exactly; ``openrl
status`` shows which. ``OPENRL_VLLM_UNEMBED_LORA=fallback`` chooses that from the start.
vLLM 0.24 applies the lm_head LoRA to sampled tokens but not to *prompt* logprobs
(vllm-project/vllm#51594): prompt-logprob jobs (``compute_logprobs`` among them) on such adapters
always go to the transformers backend (:meth:`VLLMBackend.route_reason`). Nothing is ever
dropped.

Numerics: vLLM's default ``logprobs_mode="raw_logprobs"`` returns ``log_softmax`` of the raw
logits in float32 (before temperature / top-k / top-p), the formula of
``openrl.model.logprobs.logprobs_from_logits`` and the contract of ``functions.sampler.types``;
the model runs in its config dtype (bf16), as the trainer on GPU does.

The serving knobs are in ``vllm_settings.py``, the CPU-side conversions (adapters, sampling
parameters, outputs) in ``vllm_convert.py``; both are re-exported here.

No vLLM equivalent: ``target_prompt_logprobs`` and ``prompt_alt_tokens_k``;
:meth:`VLLMBackend.route_reason` names them, and the routed backend sends such jobs to the
transformers backend (called directly, :meth:`VLLMBackend.sample` refuses them with a
``UserError`` naming the field). Everything else of the job (:class:`openrl.contract.payloads.Sample`)
maps onto ``SamplingParams``: stop token ids (EOS handled as one of them, ``ignore_eos=True``, so
``stop=[]`` really never stops), stop strings (need the model directory's tokenizer),
``topk_*_logprobs`` (``logprobs`` / ``prompt_logprobs`` = K, ranks re-sorted), per-sample
seeds (``seed`` set: one request per sample with seed ``row_seed(seed, i)``, as the
transformers backend; unseeded jobs use one request with ``n = num_samples``, except when
prompt logprobs are asked for: then one request per sample, the first with
``prompt_logprobs``, so vLLM's parallel sampling never carries prompt logprobs).
"""


from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

import torch

from functions.sampler.backends.common import has_tokenizer_files, load_tokenizer, row_seed
from functions.sampler.backends.vllm_convert import (
    check_supported,
    model_limits,
    prepare_adapter,
    prompt_fields,
    route_reason,
    sampling_kwargs,
    sequence_from_output,
    unsupported_field,
)
from functions.sampler.backends.unembed_check import check_unembed
from functions.sampler.backends.vllm_preload import EXTENSION_QUALNAME
from functions.sampler.backends.vllm_settings import (
    CUDAGRAPH_SIZES,
    DEFAULT_GPU_MEMORY,
    DEFAULT_MAX_LORAS,
    DEFAULT_MAX_NUM_SEQS,
    VLLM_LORA_RANKS,
    capture_sizes,
    configure_vllm_env,
    engine_settings,
)
from functions.sampler.stops import resolve_stop
from functions.sampler.types import SampleResult
from openrl.config import Settings
from openrl.contract.payloads import Sample
from openrl.errors import ServerError, UserError

log = logging.getLogger(__name__)

#: Longest wait, seconds, for a background adapter build (``OPENRL_VLLM_PRELOAD``) before the load
#: fails: a 4B model's rank-32 adapter builds in well under a second.
PRELOAD_WAIT_S = 120.0


# ---------------------------------------------------------------------------- backend


class VLLMBackend:
    """``SamplerBackend`` on vLLM's ``AsyncLLM`` (GPU).

    Args:
        base_model_dir: HF model directory (``config.json`` must name ``architectures``,
            e.g. ``["Qwen3ForCausalLM"]``: without it vLLM 0.24 picks a pooling runner; a
            missing entry is a ``ValueError`` here). A tokenizer there enables stop strings.
        device: must be a CUDA device (``"cuda"`` / ``"cuda:0"``).
        dtype: float32 means "the config's dtype" (the sampler's CPU default); bf16/fp16 are
            passed to vLLM.
        max_batch_rows: vLLM ``max_num_seqs``, sequences decoded together (env
            ``OPENRL_SAMPLER_MAX_NUM_SEQS``, default 256: :data:`DEFAULT_MAX_NUM_SEQS`).
        max_context: vLLM ``max_model_len`` cap (default: the model's context).
        max_loras: adapters resident in GPU slots at once (vLLM ``max_loras``; env
            ``OPENRL_VLLM_MAX_LORAS``, default 8).
        max_lora_rank: largest adapter rank accepted (one of :data:`VLLM_LORA_RANKS`; env
            ``OPENRL_VLLM_MAX_LORA_RANK``, default 32).
        max_cpu_loras: adapters cached in host memory (default ``max(max_loras, 16)``).
        gpu_memory_utilization: fraction of GPU memory vLLM may take (weights + KV cache +
            CUDA graphs; env ``OPENRL_SAMPLER_GPU_MEMORY``, older name ``OPENRL_VLLM_GPU_UTIL``;
            default 0.40, :data:`DEFAULT_GPU_MEMORY`: the embedded stack's trainer shares the
            GPU; a sampler alone on its GPU sets 0.85-0.9).
        unembed_lora: ``"keep"`` (default: vLLM applies the lm_head LoRA, checked on the
            first such adapter) or ``"fallback"`` (jobs on such adapters go to the
            transformers backend); see the module docstring; env ``OPENRL_VLLM_UNEMBED_LORA``.
        enforce_eager: disable CUDA graphs / torch.compile (faster start, slower decode).
        engine_kwargs: extra ``AsyncEngineArgs`` fields (e.g. ``compilation_config``);
            CUDA-graph capture sizes default to :func:`capture_sizes` of ``max_num_seqs``.
        cache_dir: where the unembedding check writes its probe adapter (default: a
            temporary directory).
        preload: build adapters in a background thread of vLLM's worker before ``add_lora``
            (:mod:`.vllm_preload`; default ``OPENRL_VLLM_PRELOAD``, on).

    vLLM's compile cache goes to ``$OPENRL_HOME/cache/vllm`` unless ``VLLM_CACHE_ROOT`` is
    set (:func:`configure_vllm_env`).
    """

    def __init__(
        self,
        base_model_dir: Path,
        *,
        device: str = "cuda",
        dtype: torch.dtype = torch.float32,
        max_batch_rows: int | None = None,
        max_context: int | None = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        max_cpu_loras: int | None = None,
        gpu_memory_utilization: float | None = None,
        unembed_lora: str | None = None,
        enforce_eager: bool = False,
        engine_kwargs: Mapping[str, Any] | None = None,
        cache_dir: Path | None = None,
        preload: bool | None = None,
    ):
        from openrl.observe import startup

        t_import = time.perf_counter()
        configure_vllm_env()  # before the first vLLM import: the compile cache in the state dir
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if startup.first("vllm_import"):  # this process's vLLM import (the engine core imports it again)
            startup.record("vllm_import", time.perf_counter() - t_import)

        settings = engine_settings(max_batch_rows=max_batch_rows, max_loras=max_loras, max_lora_rank=max_lora_rank,
                                   max_cpu_loras=max_cpu_loras, gpu_memory_utilization=gpu_memory_utilization,
                                   enforce_eager=enforce_eager, engine_kwargs=engine_kwargs)
        unembed_lora = unembed_lora or Settings().vllm_unembed_lora or "keep"
        if not str(device).startswith("cuda"):
            raise ValueError(f"the vLLM sampler backend needs a CUDA device, got {device!r}")
        if unembed_lora not in ("keep", "fallback"):
            raise ValueError(f"unembed_lora (OPENRL_VLLM_UNEMBED_LORA) must be 'keep' or 'fallback', got {unembed_lora!r}")
        self.base_model_dir = Path(base_model_dir)
        cfg = json.loads((self.base_model_dir / "config.json").read_text())
        if not cfg.get("architectures"):
            raise ValueError(
                f"{self.base_model_dir}/config.json has no 'architectures'; vLLM would pick a pooling "
                "runner. Set e.g. architectures=['Qwen3ForCausalLM'] when building the model."
            )
        self.tokenizer = None
        has_tok = has_tokenizer_files(self.base_model_dir)
        if has_tok:
            self.tokenizer = load_tokenizer(self.base_model_dir)
            has_tok = self.tokenizer is not None
        self.limits = model_limits(self.base_model_dir, max_context, has_tok, self.tokenizer)
        self.max_lora_rank = int(settings["max_lora_rank"])
        self.unembed_lora = unembed_lora
        #: the unembedding check's outcome: "not run", "applied (max |d| ...)", "failed: ..."
        self.unembed_check = "not run" if unembed_lora == "keep" else "off (OPENRL_VLLM_UNEMBED_LORA=fallback)"
        self._unembed_lock = asyncio.Lock()
        self._unembed_keys: set[str] = set()  # adapters with an lm_head LoRA
        self._tmp = None
        if cache_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="openrl-vllm-loras-")
            cache_dir = Path(self._tmp.name)
        self.cache_dir = Path(cache_dir)
        vdtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")
        kw: dict[str, Any] = dict(
            model=str(self.base_model_dir),
            dtype=vdtype,
            enable_lora=True,
            max_model_len=int(self.limits.max_context),
            skip_tokenizer_init=not has_tok,
            seed=0,
        )
        kw.update(settings)
        cfg = Settings()
        if cfg.sleep_after > 0:  # idle sleep (openrl/transport/bindings/idle_sleep.py): vLLM's sleep mode
            kw.setdefault("enable_sleep_mode", True)
        self.preload = cfg.vllm_preload if preload is None else bool(preload)
        if self.preload:
            kw.setdefault("worker_extension_cls", EXTENSION_QUALNAME)
            if kw["worker_extension_cls"] != EXTENSION_QUALNAME:
                raise ValueError(f"OPENRL_VLLM_PRELOAD needs worker_extension_cls={EXTENSION_QUALNAME}, "
                                 f"engine_kwargs set {kw['worker_extension_cls']!r}")
        self.engine_args = kw
        log.info("vLLM engine: max_num_seqs=%s max_loras=%s gpu_memory_utilization=%s cache=%s",
                 kw["max_num_seqs"], kw["max_loras"], kw["gpu_memory_utilization"], os.environ.get("VLLM_CACHE_ROOT"))
        # the engine-core process: spawn and import, weights, torch.compile, profiling, KV cache,
        # CUDA-graph capture, warm-up (vLLM's own log splits it)
        with startup.timed("vllm_engine_core"):
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        from openrl.storage.compile_cache import merge_triton

        n = merge_triton(Path(os.environ["VLLM_CACHE_ROOT"]), Path(os.environ["TRITON_CACHE_DIR"]))
        if n:
            log.info("%d Triton kernels of this start's compile kept in %s for the next start", n,
                     os.environ["TRITON_CACHE_DIR"])
        self._ids: dict[str, int] = {}  # adapter key -> LoRA int id
        self._requests: dict[str, Any] = {}  # key -> LoRARequest
        self._next_id = 1
        self._closed = False

    # ------------------------------------------------------------------ idle sleep

    async def sleep(self) -> bool:
        """vLLM's sleep mode, level 1: the weights (LoRA slots included) go to host memory and the
        KV cache is dropped, so the GPU memory is free until :meth:`wake`.

        Raises:
            ServerError: the engine was built without ``enable_sleep_mode`` (set when
                ``OPENRL_SLEEP_AFTER`` > 0 at start).
        """
        if not self.engine_args.get("enable_sleep_mode"):
            raise ServerError("the vLLM engine was started without sleep mode (OPENRL_SLEEP_AFTER was 0 when it "
                              "started); it cannot give its GPU memory back while idle")
        await self.engine.sleep(level=1)
        return True

    async def wake(self) -> None:
        """``wake_up()``: the weights back from host memory, the KV cache allocated again."""
        await self.engine.wake_up()

    # ------------------------------------------------------------------ adapters

    async def load_adapter(self, key: str, directory: Path) -> None:
        """Check (see :func:`prepare_adapter`) and register with vLLM; the first adapter with
        an unembedding LoRA also runs :meth:`_check_unembed`.

        Raises:
            UserError("model_path", ...): unusable adapter (vLLM's own error included).
        """
        from openrl.observe import metrics

        if key in self._ids:
            return
        t0 = time.perf_counter()
        info = await asyncio.to_thread(prepare_adapter, Path(directory), max_rank=self.max_lora_rank)
        t1 = time.perf_counter()
        waited = await self._register(key, Path(directory))
        t2 = time.perf_counter()
        metrics.ADAPTER_LOAD_PART_SECONDS.labels("check").observe(t1 - t0)
        if self.preload:
            metrics.ADAPTER_LOAD_PART_SECONDS.labels("preload").observe(waited)
        metrics.ADAPTER_LOAD_PART_SECONDS.labels("engine").observe(t2 - t1 - waited)
        log.info("adapter %s loaded in %.3f s: check %.3f s, preload %.3f s, engine %.3f s", key, t2 - t0,
                 t1 - t0, waited, t2 - t1 - waited)
        if info["unembed"]:
            self._unembed_keys.add(key)
            if self.unembed_lora == "keep" and self.unembed_check == "not run":
                await self._check_unembed(key, Path(directory))

    async def _register(self, key: str, path: Path) -> float:
        """Register adapter ``key`` (PEFT directory ``path``) with vLLM under a new LoRA id; with
        ``preload`` on, have the worker build it in the background first (:meth:`_preload`).
        Returns the seconds spent waiting for that build (0.0 without preload).

        Raises:
            UserError("model_path", ...): vLLM could not load or refused the adapter.
        """
        from vllm.lora.request import LoRARequest

        lid = self._next_id
        self._next_id += 1
        req = LoRARequest(lora_name=key, lora_int_id=lid, lora_path=str(path))
        waited = await self._preload(key, lid, path) if self.preload else 0.0
        try:
            ok = await self.engine.add_lora(req)
        except Exception as e:
            raise UserError("model_path", f"vLLM could not load the adapter: {type(e).__name__}: {e}") from None
        if ok is False:
            raise UserError("model_path", "vLLM refused the adapter")
        self._ids[key] = lid
        self._requests[key] = req
        return waited

    async def _preload(self, key: str, lid: int, path: Path) -> float:
        """Have vLLM's worker build adapter ``lid`` in a background thread of the engine-core
        process (:mod:`.vllm_preload`) and wait, polling, until it is built or failed; the
        ``add_lora`` that follows then only registers it on the engine core's loop (a failed build
        is raised by that ``add_lora``). Returns the seconds waited.

        Raises:
            UserError("model_path", ...): the build is still not done after
                :data:`PRELOAD_WAIT_S` (the preload is dropped).
        """
        t0 = time.perf_counter()
        await self.engine.collective_rpc("openrl_preload_lora", args=(key, lid, str(path)))
        pause = 0.002
        while True:
            states = await self.engine.collective_rpc("openrl_preload_state", args=(lid,))
            if all(st != "pending" for st in states):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > PRELOAD_WAIT_S:
                await self.engine.collective_rpc("openrl_preload_drop", args=(lid,))
                raise UserError("model_path", f"vLLM's worker did not finish reading the adapter within "
                                f"{PRELOAD_WAIT_S:.0f} s (OPENRL_VLLM_PRELOAD)")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.02)

    async def _check_unembed(self, key: str, directory: Path) -> None:
        """Does this vLLM apply the unembedding LoRA to sampled tokens? Runs
        :func:`functions.sampler.backends.unembed_check.check_unembed` once (greedy first tokens
        under adapter ``key`` and under a probe copy whose lm_head LoRA moves chosen tokens by
        tens of nats). If vLLM ignores it (or the check fails), ``unembed_lora`` becomes
        ``"fallback"``: such adapters are sampled by the transformers backend, logged as an
        error and shown by ``openrl status``. Never raises."""
        async with self._unembed_lock:
            if self.unembed_check != "not run":
                return
            try:
                ok, summary = await check_unembed(self.sample, self._register, self.unload_adapter, key, directory,
                                                  self.cache_dir, self.limits.vocab_size)
                if ok:
                    self.unembed_check = f"applied to sampled tokens ({summary})"
                    log.info("vLLM applies the unembedding LoRA: %s", summary)
                else:
                    self.unembed_check = (f"failed: vLLM ignored the lm_head LoRA ({summary}); those adapters are "
                                          "sampled by the transformers backend")
            except Exception as e:
                self.unembed_check = f"failed: the check raised {type(e).__name__}: {str(e)[:200]}"
            if self.unembed_check.startswith("failed"):
                self.unembed_lora = "fallback"
                log.error("unembedding LoRA check %s", self.unembed_check)

    # ------------------------------------------------------------------ routing

    name = "vllm"

    def route_reason(self, job: Sample) -> str | None:
        """Why this backend should not serve ``job`` (the routed backend then gives it to the
        transformers backend), or None: :func:`vllm_convert.route_reason` with this backend's
        adapters that have an unembedding LoRA and its ``unembed_lora`` mode."""
        return route_reason(job, self._unembed_keys, self.unembed_lora)

    def describe(self) -> dict:
        """``{"unembed_lora": mode, "unembed_check": outcome}`` for ``openrl status``."""
        return {"unembed_lora": self.unembed_lora, "unembed_check": self.unembed_check}

    async def unload_adapter(self, key: str) -> None:
        """Remove adapter ``key`` from vLLM (no-op if absent)."""
        lid = self._ids.pop(key, None)
        self._requests.pop(key, None)
        self._unembed_keys.discard(key)
        if lid is not None:
            try:
                await self.engine.remove_lora(lid)
            except Exception:  # already evicted from vLLM's caches
                log.debug("remove_lora(%s) failed", lid, exc_info=True)

    # ------------------------------------------------------------------ sampling

    async def sample(self, job: Sample) -> SampleResult:
        """Run one validated job; concurrent calls share vLLM's continuous batches.

        Raises:
            UserError: a field this backend does not support. ServerError: closed, adapter
                not loaded, or the vLLM request failed.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self._closed:
            raise ServerError("the sampler backend is closed")
        check_supported(job)
        reason = self.route_reason(job)
        if reason is not None and job.model_path in self._unembed_keys:
            raise ServerError(f"{reason}: vLLM would not apply this adapter's lm_head LoRA ({self.unembed_check}); "
                              "the routed sampler backend serves such jobs with transformers")
        lora = None
        if job.model_path is not None:
            lora = self._requests.get(job.model_path)
            if lora is None:
                raise ServerError(f"adapter {job.model_path!r} is not loaded in the vLLM backend")
        params = job.sampling_params
        ids, strs = resolve_stop(params.stop_list, self.limits.eos_token_ids)
        if strs and not self.limits.has_tokenizer:
            raise UserError("sampling_params.stop", "this model has no tokenizer; use stop token ids")
        base = sampling_kwargs(job, ids, strs)
        want_prompt = bool(job.prompt_logprobs or job.topk_prompt_logprobs)
        prompt = TokensPrompt(prompt_token_ids=list(job.prompt_tokens))
        if params.seed is not None:
            specs = [dict(n=1, seed=row_seed(int(params.seed), i)) for i in range(job.num_samples)]
        elif want_prompt and job.num_samples > 1:  # no prompt logprobs through vLLM's parallel sampling
            specs = [dict(n=1, seed=None) for _ in range(job.num_samples)]
        else:
            specs = [dict(n=job.num_samples, seed=None)]
        if want_prompt:
            specs[0]["prompt_logprobs"] = int(job.topk_prompt_logprobs)

        async def one(spec: dict):
            sp = SamplingParams(**base, **spec, output_kind=RequestOutputKind.FINAL_ONLY)
            final = None
            async for out in self.engine.generate(prompt, sp, uuid.uuid4().hex, lora_request=lora):
                final = out
            if final is None or not final.finished:
                raise ServerError("vLLM request produced no final output")
            return final

        try:
            finals = await asyncio.gather(*(one(s) for s in specs))
        except (UserError, ServerError):
            raise
        except Exception as e:
            raise ServerError(f"vLLM sampling failed: {type(e).__name__}: {e}") from None
        k = int(job.topk_sample_logprobs)
        seqs = [sequence_from_output(o, k) for f in finals for o in sorted(f.outputs, key=lambda o: o.index)]
        res = SampleResult(sequences=seqs[: job.num_samples])
        if want_prompt:
            prompt_fields(res, job, finals[0].prompt_logprobs)
        return res

    async def close(self) -> None:
        """Shut the engine core down; further calls fail with ``ServerError``."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.shutdown()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()


__all__ = [
    "CUDAGRAPH_SIZES",
    "DEFAULT_GPU_MEMORY",
    "DEFAULT_MAX_LORAS",
    "DEFAULT_MAX_NUM_SEQS",
    "VLLMBackend",
    "VLLM_LORA_RANKS",
    "capture_sizes",
    "check_supported",
    "configure_vllm_env",
    "unsupported_field",
    "engine_settings",
    "prepare_adapter",
    "prompt_fields",
    "sampling_kwargs",
    "sequence_from_output",
]
