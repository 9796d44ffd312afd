"""vLLM sampler backend: multi-LoRA continuous batching on a GPU, behind ``SamplerBackend``.

``make_backend("vllm", ...)`` (or ``"auto"`` when CUDA and ``vllm`` are present) builds a
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
(Tinker's default) is *dropped with a warning* by default (``unembed_lora="drop"``): vLLM
0.24 lists ``lm_head`` among Qwen3's LoRA modules, but on a tied-embedding model its
``lm_head`` is the input embedding and whether the delta is applied to the logits was not
verified (docs/benchmarks.md, "H200 (issue 8)"). Dropping it changes the sampled
distribution by exactly that delta; the logprobs returned are then those of the adapter
without its unembedding part. ``unembed_lora="keep"`` passes it through untouched.

Numerics: vLLM's default ``logprobs_mode="raw_logprobs"`` returns ``log_softmax`` of the raw
logits in float32 (before temperature / top-k / top-p), the contract of ``engine.py``;
the model runs in its config dtype (bf16), as the trainer on GPU does.

Not supported here (a ``UserError`` naming the field): ``target_prompt_logprobs`` and
``prompt_alt_tokens_k`` (no vLLM equivalent). Everything else of ``SampleJob`` maps onto
``SamplingParams``: stop token ids (EOS handled as one of them, ``ignore_eos=True``, so
``stop=[]`` really never stops), stop strings (need the model directory's tokenizer),
``topk_*_logprobs`` (``logprobs`` / ``prompt_logprobs`` = K, ranks re-sorted), per-sample
seeds (``seed`` set: one request per sample with seed ``row_seed(seed, i)``, as the
transformers backend; unseeded jobs use one request with ``n = num_samples``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Mapping

import torch

from functions.sampler.engine import (
    TOPK_MASK_LOGPROB,
    ModelLimits,
    SampledSequence,
    SampleJob,
    SampleResult,
)
from functions.sampler.stops import resolve_stop
from openrl.errors import ServerError, UserError
from openrl.model.lora import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, UNEMBED_TARGET

log = logging.getLogger(__name__)

#: LoRA ranks vLLM 0.24 accepts for ``max_lora_rank``.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

#: Share of the GPU's memory vLLM takes (weights + KV cache + CUDA graphs) when nothing says
#: otherwise. The embedded stack (``openrl serve``) runs the trainer on the same GPU, and the
#: trainer takes about 0.45 of it (Qwen3-4B, 8 runs x 1024 tokens co-batched: 51 GB of 141 GB
#: on an H200), so the sampler keeps to 0.40. A sampler alone on its GPU (the GKE sampler
#: Service) sets ``OPENRL_SAMPLER_GPU_MEMORY=0.85``..``0.9``.
DEFAULT_GPU_MEMORY = 0.40
#: Sequences vLLM decodes together (``max_num_seqs``): at least 128 concurrent samples (an
#: RL step of 8 runs x 4 prompts x 4 samples) must share one decode batch.
DEFAULT_MAX_NUM_SEQS = 256
#: Adapters resident in GPU slots at once (``max_loras``): 8 runs' snapshots sampled together.
DEFAULT_MAX_LORAS = 8
#: CUDA-graph batch sizes captured at engine start (those <= ``max_num_seqs``, plus
#: ``max_num_seqs`` itself): a decode batch is padded up to the next size, so the steps
#: above 64 stay within 25 % of the batch, and fewer sizes than vLLM's default list (one
#: every 8) keep the capture at engine start short.
CUDAGRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 448, 512)

#: Environment names (first one set wins) of each setting; ``OPENRL_VLLM_GPU_UTIL`` is the
#: older name of ``OPENRL_SAMPLER_GPU_MEMORY``.
GPU_MEMORY_ENV = ("OPENRL_SAMPLER_GPU_MEMORY", "OPENRL_VLLM_GPU_UTIL")
MAX_NUM_SEQS_ENV = ("OPENRL_SAMPLER_MAX_NUM_SEQS", "OPENRL_VLLM_MAX_NUM_SEQS")
MAX_LORAS_ENV = ("OPENRL_VLLM_MAX_LORAS",)
MAX_LORA_RANK_ENV = ("OPENRL_VLLM_MAX_LORA_RANK",)


def _env_value(names: tuple[str, ...], env: Mapping[str, str]) -> str | None:
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            return v
    return None


def configure_vllm_env(env: "os._Environ[str] | dict[str, str] | None" = None) -> dict[str, str]:
    """Environment vLLM reads at import and engine start; call before importing ``vllm``.

    - ``VLLM_CACHE_ROOT`` (torch.compile artefacts, CUDA-graph and kernel caches): unless set,
      ``$OPENRL_HOME/cache/vllm`` (default ``~/.openrl/cache/vllm``), so the state directory
      keeps the compile cache and the second ``openrl serve`` starts the engine faster.
    - ``VLLM_NO_USAGE_STATS=1`` unless set (no usage reporting from a self-hosted service).
    - ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unless set: the sampler process has initialised CUDA
      (device resolution, ``torch.cuda.is_available()``) before the engine starts, and vLLM's
      engine-core process then fails with "Cannot re-initialize CUDA in forked subprocess"
      (seen on the H200, 2026-12-01).

    Returns the values it set (empty when everything was set already).
    """
    env = os.environ if env is None else env
    done: dict[str, str] = {}
    if not env.get("VLLM_CACHE_ROOT"):
        home = Path(env.get("OPENRL_HOME") or Path.home() / ".openrl").expanduser()
        done["VLLM_CACHE_ROOT"] = str(home / "cache" / "vllm")
    if not env.get("VLLM_NO_USAGE_STATS"):
        done["VLLM_NO_USAGE_STATS"] = "1"
    if not env.get("VLLM_WORKER_MULTIPROC_METHOD"):
        done["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    env.update(done)
    return done


def capture_sizes(max_num_seqs: int) -> list[int]:
    """CUDA-graph capture sizes covering batches of 1..``max_num_seqs`` (see :data:`CUDAGRAPH_SIZES`)."""
    n = max(1, int(max_num_seqs))
    return sorted({s for s in CUDAGRAPH_SIZES if s <= n} | {n})


def engine_settings(
    *,
    max_batch_rows: int | None = None,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
    max_cpu_loras: int | None = None,
    gpu_memory_utilization: float | None = None,
    enforce_eager: bool = False,
    engine_kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The serving knobs of the vLLM engine: arguments, else environment, else defaults.

    Returns ``AsyncEngineArgs`` fields: ``max_num_seqs`` (:data:`DEFAULT_MAX_NUM_SEQS`),
    ``max_loras`` (:data:`DEFAULT_MAX_LORAS`), ``max_lora_rank`` (32), ``max_cpu_loras``
    (``max(max_loras, 16)``), ``gpu_memory_utilization`` (:data:`DEFAULT_GPU_MEMORY`),
    ``enforce_eager`` and, unless eager or given in ``engine_kwargs``, a
    ``compilation_config`` with ``cudagraph_capture_sizes`` up to ``max_num_seqs``;
    ``engine_kwargs`` entries are merged last (a ``compilation_config`` dict key by key).

    Raises:
        ValueError: a value out of range (rank not in :data:`VLLM_LORA_RANKS`, memory share
            not in (0, 1], fewer than 1 sequence or adapter).
    """
    env = os.environ if env is None else env
    seqs = int(max_batch_rows or _env_value(MAX_NUM_SEQS_ENV, env) or DEFAULT_MAX_NUM_SEQS)
    loras = int(max_loras or _env_value(MAX_LORAS_ENV, env) or DEFAULT_MAX_LORAS)
    rank = int(max_lora_rank or _env_value(MAX_LORA_RANK_ENV, env) or 32)
    mem = float(gpu_memory_utilization or _env_value(GPU_MEMORY_ENV, env) or DEFAULT_GPU_MEMORY)
    if rank not in VLLM_LORA_RANKS:
        raise ValueError(f"max_lora_rank must be one of {VLLM_LORA_RANKS}, got {rank}")
    if not 0 < mem <= 1:
        raise ValueError(f"gpu_memory_utilization ({'/'.join(GPU_MEMORY_ENV)}) must be in (0, 1], got {mem}")
    if seqs < 1 or loras < 1:
        raise ValueError(f"max_num_seqs and max_loras must be >= 1, got {seqs} and {loras}")
    kw: dict[str, Any] = dict(
        max_num_seqs=seqs,
        max_loras=loras,
        max_lora_rank=rank,
        max_cpu_loras=int(max_cpu_loras or max(loras, 16)),
        gpu_memory_utilization=mem,
        enforce_eager=bool(enforce_eager),
    )
    extra = dict(engine_kwargs or {})
    if not enforce_eager and not extra.get("enforce_eager"):
        cc = dict(extra.pop("compilation_config", None) or {})
        cc.setdefault("cudagraph_capture_sizes", capture_sizes(seqs))
        kw["compilation_config"] = cc
    kw.update(extra)
    return kw


# ---------------------------------------------------------------------------- adapters


def prepare_adapter(
    src: Path, dst: Path, *, unembed_lora: str = "drop", max_rank: int | None = None
) -> tuple[Path, dict]:
    """Make a PEFT adapter directory loadable by vLLM.

    Args:
        src: directory with ``adapter_model.safetensors`` + ``adapter_config.json`` (the
            trainer's export: float32 ``base_model.model.<path>.lora_{A,B}.weight``).
        dst: where a converted copy is written when one is needed (created; replaced).
        unembed_lora: ``"drop"``: remove ``lm_head`` LoRA tensors and the ``lm_head`` target
            (warning logged); ``"keep"``: leave them.
        max_rank: the engine's ``max_lora_rank``; a larger ``r`` is a ``UserError``.

    Returns:
        ``(directory to give vLLM, info)``: ``src`` itself when nothing had to change, else
        ``dst``; info = ``{"rank", "alpha", "targets", "dropped": [tensor names]}``.

    Raises:
        UserError("model_path", ...): files missing/unreadable, rank too large, or nothing
            left to adapt after dropping.
    """
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    wpath, cpath = src / ADAPTER_WEIGHTS_NAME, src / ADAPTER_CONFIG_NAME
    if not wpath.is_file() or not cpath.is_file():
        raise UserError("model_path", f"{src} holds no PEFT adapter ({ADAPTER_WEIGHTS_NAME} + {ADAPTER_CONFIG_NAME})")
    try:
        cfg = json.loads(cpath.read_text())
        rank = int(cfg["r"])
    except Exception as e:
        raise UserError("model_path", f"unreadable adapter config in {src}: {e}") from None
    if max_rank is not None and rank > max_rank:
        raise UserError("model_path", f"adapter rank {rank} exceeds the sampler's max_lora_rank {max_rank}")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    info = {"rank": rank, "alpha": cfg.get("lora_alpha"), "targets": sorted(targets), "dropped": []}
    has_unembed = any(str(t).rsplit(".", 1)[-1] == UNEMBED_TARGET for t in targets)
    if unembed_lora == "keep" or not has_unembed:
        return src, info
    if unembed_lora != "drop":
        raise ValueError(f"unembed_lora must be 'drop' or 'keep', got {unembed_lora!r}")
    try:
        sd = load_file(str(wpath))
    except Exception as e:
        raise UserError("model_path", f"cannot read adapter weights in {src}: {e}") from None

    def is_unembed(k: str) -> bool:  # base_model.model.lm_head.lora_{A,B}[.default].weight
        parts = k.split(".")
        return UNEMBED_TARGET in parts and ("lora_A" in parts or "lora_B" in parts)

    dropped = sorted(k for k in sd if is_unembed(k))
    kept = {k: v for k, v in sd.items() if k not in dropped}
    new_targets = [t for t in targets if str(t).rsplit(".", 1)[-1] != UNEMBED_TARGET]
    if not new_targets or not kept:
        raise UserError("model_path", "the adapter only adapts lm_head, which the vLLM sampler does not apply")
    log.warning(
        "adapter %s: dropping %d lm_head LoRA tensors for vLLM (unembed_lora='drop'); samples and "
        "logprobs use the adapter without its unembedding delta", src, len(dropped)
    )
    cfg = dict(cfg, target_modules=new_targets)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    save_file(kept, str(dst / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    (dst / ADAPTER_CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True))
    info["dropped"] = dropped
    info["targets"] = sorted(new_targets)
    return dst, info


# ---------------------------------------------------------------------------- requests


def check_supported(job: SampleJob) -> None:
    """Raise ``UserError`` for job fields the vLLM backend cannot serve."""
    if job.target_prompt_ids is not None:
        raise UserError("target_prompt_logprobs", "not supported by the vLLM sampler backend")
    if job.prompt_alt_tokens_k:
        raise UserError("prompt_alt_tokens_k", "not supported by the vLLM sampler backend")


def sampling_kwargs(job: SampleJob, stop_ids: frozenset[int], stop_strs: tuple[str, ...]) -> dict:
    """``vllm.SamplingParams`` keyword arguments for one request of ``job`` (``n``, ``seed``
    and ``prompt_logprobs`` are set by the caller). ``job.max_tokens`` must be an int."""
    return dict(
        temperature=float(job.temperature),
        top_p=float(job.top_p),
        top_k=int(job.top_k) if job.top_k and job.top_k > 0 else 0,
        max_tokens=int(job.max_tokens),
        ignore_eos=True,  # EOS is in stop_ids unless the job said stop=[]
        stop_token_ids=sorted(stop_ids),
        stop=list(stop_strs) or None,
        include_stop_str_in_output=True,
        detokenize=bool(stop_strs),
        logprobs=int(job.topk_sample_logprobs),
    )


def _entries(pos: Any) -> list[tuple[int, float, int]]:
    """``[(token id, logprob, rank)]`` of one position's vLLM logprobs (a dict of
    ``Logprob``, or anything with ``items()``)."""
    return [(int(t), float(lp.logprob), int(getattr(lp, "rank", 0) or 0)) for t, lp in pos.items()]


def _topk_row(pos: Any, k: int) -> tuple[list[int], list[float]]:
    """The K best (id, logprob) of a position, best first, padded with Tinker's mask."""
    best = sorted(_entries(pos), key=lambda e: (-e[1], e[0]))[:k]
    ids = [e[0] for e in best] + [0] * (k - len(best))
    lps = [e[1] for e in best] + [TOPK_MASK_LOGPROB] * (k - len(best))
    return ids, lps


def sequence_from_output(out: Any, k: int) -> SampledSequence:
    """A ``SampledSequence`` from a vLLM ``CompletionOutput`` requested with ``logprobs=k``.

    The sampled token's logprob is read from each position's dict (vLLM always includes
    the sampled token); ``finish_reason`` "stop" -> "stop", "length" -> "length".

    Raises:
        ServerError: the request was aborted or logprobs are missing.
    """
    toks = [int(t) for t in out.token_ids]
    lps_pos = out.logprobs
    if lps_pos is None or len(lps_pos) != len(toks):
        raise ServerError("vLLM returned no logprobs for the sampled tokens")
    lps, tk_i, tk_v = [], [], []
    for t, pos in zip(toks, lps_pos):
        d = {e[0]: e[1] for e in _entries(pos)}
        if t not in d:
            raise ServerError(f"vLLM logprobs miss the sampled token {t}")
        lps.append(d[t])
        if k:
            i, v = _topk_row(pos, k)
            tk_i.append(i)
            tk_v.append(v)
    reason = out.finish_reason
    if reason not in ("stop", "length"):
        raise ServerError(f"vLLM request ended with finish_reason={reason!r}")
    return SampledSequence(tokens=toks, logprobs=lps, stop_reason=reason, topk=(tk_i, tk_v) if k else None)


def prompt_fields(res: SampleResult, job: SampleJob, prompt_lps: Any) -> None:
    """Fill ``prompt_logprobs`` / ``topk_prompt`` of ``res`` from vLLM's per-prompt-position
    logprobs (entry 0 None; entry t a dict holding prompt[t] and the top-K)."""
    P = len(job.prompt)
    K = job.topk_prompt_logprobs
    if prompt_lps is None or len(prompt_lps) != P:
        raise ServerError("vLLM returned no prompt logprobs")
    first = P - job.prompt_logprobs_last_n if job.prompt_logprobs_last_n is not None else 1
    if job.prompt_logprobs:
        vals = [float("nan")]
        for t in range(1, P):
            d = {e[0]: e[1] for e in _entries(prompt_lps[t])}
            vals.append(d[job.prompt[t]] if t >= first and job.prompt[t] in d else float("nan"))
        res.prompt_logprobs = vals
    if K:
        empty_i, empty_v = [0] * K, [TOPK_MASK_LOGPROB] * K
        ids, lps = [list(empty_i)], [list(empty_v)]
        for t in range(1, P):
            if t >= first:
                i, v = _topk_row(prompt_lps[t], K)
            else:
                i, v = list(empty_i), list(empty_v)
            ids.append(i)
            lps.append(v)
        res.topk_prompt = (ids, lps)


def _model_limits(model_dir: Path, max_context: int | None, has_tokenizer: bool, tokenizer: Any) -> ModelLimits:
    """Vocabulary size, context and EOS ids from ``config.json`` / ``generation_config.json``
    (and the tokenizer) without loading weights."""
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    vocab = int(text["vocab_size"])
    ctx = int(text.get("max_position_embeddings") or 2**31)
    if max_context is not None:
        ctx = min(ctx, int(max_context))
    eos: set[int] = set()

    def add(x: Any) -> None:
        if isinstance(x, int):
            eos.add(x)
        elif isinstance(x, (list, tuple)):
            eos.update(int(i) for i in x)

    add(text.get("eos_token_id"))
    gpath = model_dir / "generation_config.json"
    if gpath.is_file():
        try:
            add(json.loads(gpath.read_text()).get("eos_token_id"))
        except ValueError:
            pass
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return ModelLimits(vocab_size=vocab, max_context=ctx, eos_token_ids=frozenset(i for i in eos if 0 <= i < vocab),
                       has_tokenizer=has_tokenizer)


def _has_tokenizer_files(d: Path) -> bool:
    return any((d / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"))


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
        unembed_lora: ``"drop"`` (default) or ``"keep"`` (see the module docstring; env
            ``OPENRL_VLLM_UNEMBED_LORA``).
        enforce_eager: disable CUDA graphs / torch.compile (faster start, slower decode).
        engine_kwargs: extra ``AsyncEngineArgs`` fields (e.g. ``compilation_config``);
            CUDA-graph capture sizes default to :func:`capture_sizes` of ``max_num_seqs``.
        cache_dir: where converted adapter copies go (default: a temporary directory).

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
    ):
        configure_vllm_env()  # before the first vLLM import: the compile cache in the state dir
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        env = os.environ
        settings = engine_settings(max_batch_rows=max_batch_rows, max_loras=max_loras, max_lora_rank=max_lora_rank,
                                   max_cpu_loras=max_cpu_loras, gpu_memory_utilization=gpu_memory_utilization,
                                   enforce_eager=enforce_eager, engine_kwargs=engine_kwargs)
        unembed_lora = unembed_lora or env.get("OPENRL_VLLM_UNEMBED_LORA", "drop")
        if not str(device).startswith("cuda"):
            raise ValueError(f"the vLLM sampler backend needs a CUDA device, got {device!r}")
        if unembed_lora not in ("drop", "keep"):
            raise ValueError(f"unembed_lora must be 'drop' or 'keep', got {unembed_lora!r}")
        self.base_model_dir = Path(base_model_dir)
        cfg = json.loads((self.base_model_dir / "config.json").read_text())
        if not cfg.get("architectures"):
            raise ValueError(
                f"{self.base_model_dir}/config.json has no 'architectures'; vLLM would pick a pooling "
                "runner. Set e.g. architectures=['Qwen3ForCausalLM'] when building the model."
            )
        self.tokenizer = None
        has_tok = _has_tokenizer_files(self.base_model_dir)
        if has_tok:
            from functions.sampler.hf_backend import _load_tokenizer

            self.tokenizer = _load_tokenizer(self.base_model_dir)
            has_tok = self.tokenizer is not None
        self.limits = _model_limits(self.base_model_dir, max_context, has_tok, self.tokenizer)
        self.max_lora_rank = int(settings["max_lora_rank"])
        self.unembed_lora = unembed_lora
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
        self.engine_args = kw
        log.info("vLLM engine: max_num_seqs=%s max_loras=%s gpu_memory_utilization=%s cache=%s",
                 kw["max_num_seqs"], kw["max_loras"], kw["gpu_memory_utilization"], env.get("VLLM_CACHE_ROOT"))
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        self._ids: dict[str, int] = {}  # adapter key -> LoRA int id
        self._requests: dict[str, Any] = {}  # key -> LoRARequest
        self._next_id = 1
        self._closed = False

    # ------------------------------------------------------------------ adapters

    async def load_adapter(self, key: str, directory: Path) -> None:
        """Convert if needed (see :func:`prepare_adapter`) and register with vLLM.

        Raises:
            UserError("model_path", ...): unusable adapter (vLLM's own error included).
        """
        from vllm.lora.request import LoRARequest

        if key in self._ids:
            return
        dst = self.cache_dir / hashlib.sha256(key.encode()).hexdigest()[:32]
        path, info = await asyncio.to_thread(
            prepare_adapter, Path(directory), dst, unembed_lora=self.unembed_lora, max_rank=self.max_lora_rank
        )
        lid = self._next_id
        self._next_id += 1
        req = LoRARequest(lora_name=key, lora_int_id=lid, lora_path=str(path))
        try:
            ok = await self.engine.add_lora(req)
        except Exception as e:
            raise UserError("model_path", f"vLLM could not load the adapter: {type(e).__name__}: {e}") from None
        if ok is False:
            raise UserError("model_path", "vLLM refused the adapter")
        self._ids[key] = lid
        self._requests[key] = req

    async def unload_adapter(self, key: str) -> None:
        lid = self._ids.pop(key, None)
        self._requests.pop(key, None)
        if lid is not None:
            try:
                await self.engine.remove_lora(lid)
            except Exception:  # already evicted from vLLM's caches
                log.debug("remove_lora(%s) failed", lid, exc_info=True)
        dst = self.cache_dir / hashlib.sha256(key.encode()).hexdigest()[:32]
        if dst.exists():
            await asyncio.to_thread(shutil.rmtree, dst, True)

    # ------------------------------------------------------------------ sampling

    async def sample(self, job: SampleJob) -> SampleResult:
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
        lora = None
        if job.adapter is not None:
            lora = self._requests.get(job.adapter)
            if lora is None:
                raise ServerError(f"adapter {job.adapter!r} is not loaded in the vLLM backend")
        ids, strs = resolve_stop(job.stop, self.limits.eos_token_ids)
        if strs and not self.limits.has_tokenizer:
            raise UserError("sampling_params.stop", "this model has no tokenizer; use stop token ids")
        base = sampling_kwargs(job, ids, strs)
        want_prompt = bool(job.prompt_logprobs or job.topk_prompt_logprobs)
        prompt = TokensPrompt(prompt_token_ids=list(job.prompt))
        if job.seed is not None:
            from functions.sampler.hf_backend import row_seed

            specs = [dict(n=1, seed=row_seed(int(job.seed), i)) for i in range(job.num_samples)]
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
    "engine_settings",
    "prepare_adapter",
    "prompt_fields",
    "sampling_kwargs",
    "sequence_from_output",
]
