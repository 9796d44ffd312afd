"""The vLLM backend's serving knobs: engine arguments from explicit values, else the
environment, else defaults; the environment vLLM reads at import; CUDA-graph capture sizes.
Imports nothing of vLLM (tests run it without a GPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from openrl.config import DEFAULT_HOME, Settings

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
ENGINE_ARGS_ENV = ("OPENRL_VLLM_ENGINE_ARGS",)


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
    - ``TRITON_CACHE_DIR``: unless set, ``$OPENRL_HOME/cache/triton``. vLLM points Triton at a
      directory of its compile hash only while it compiles the model; a start that loads the
      compiled model from the cache leaves Triton at its default, so the LoRA shrink/expand and
      sampler kernels were JIT-compiled again at every restart (about 20 s of the engine core's
      start on an H100, bench/stack_samples.py, 2026-12-06). With one directory for every start
      and :func:`openrl.storage.compile_cache.merge_triton` copying the first start's kernels into
      it, the second start finds them.
    - ``VLLM_NO_USAGE_STATS=1`` unless set (no usage reporting from a self-hosted service).
    - ``VLLM_WORKER_MULTIPROC_METHOD=fork`` and ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` unless set:
      vLLM's engine-core process is forked from the sampler process instead of spawned, so it
      does not import torch and vLLM a second time in a fresh interpreter. On an H100
      (bench/stack_h200.py ``--sections cold``, both orders in one job, 2026-12-07) the engine
      core started in 40-41 s forked against 64-67 s spawned, and the first sample came 77-84 s
      after ``openrl serve`` against 106-114 s (docs/benchmarks.md, fourteenth session). A fork
      needs a parent in which CUDA was never initialised: the NVML check keeps
      ``torch.cuda.is_available()`` (device resolution) from initialising the driver (with the
      CUDA runtime's check, the forked engine core failed with "Cannot re-initialize CUDA in
      forked subprocess" on the H200, 2026-12-01), the compile-cache tag reads the GPU's name
      through NVML (:mod:`functions.sampler.compile_sync`), and where CUDA is initialised all
      the same (a transformers backend started first in the process) vLLM itself falls back to
      spawn with a warning. ``functions.sampler.new()`` sets the NVML check at the sampler
      process's start. Set ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` to get the old start.

    Returns the values it set (empty when everything was set already).
    """
    home = Settings().home_dir if env is None else Path(env.get("OPENRL_HOME") or DEFAULT_HOME).expanduser()
    env = os.environ if env is None else env  # written: vLLM reads these itself (and its workers inherit them)
    done: dict[str, str] = {}
    if not env.get("VLLM_CACHE_ROOT"):
        done["VLLM_CACHE_ROOT"] = str(home / "cache" / "vllm")
    if not env.get("TRITON_CACHE_DIR"):
        done["TRITON_CACHE_DIR"] = str(home / "cache" / "triton")
    if not env.get("VLLM_NO_USAGE_STATS"):
        done["VLLM_NO_USAGE_STATS"] = "1"
    if not env.get("VLLM_WORKER_MULTIPROC_METHOD"):
        done["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    if not env.get("PYTORCH_NVML_BASED_CUDA_CHECK"):
        done["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
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
    ``engine_kwargs`` entries are merged last (a ``compilation_config`` dict key by key), over
    ``OPENRL_VLLM_ENGINE_ARGS`` (JSON; :attr:`openrl.config.Settings.vllm_engine_args`).

    Raises:
        ValueError: a value out of range (rank not in :data:`VLLM_LORA_RANKS`, memory share
            not in (0, 1], fewer than 1 sequence or adapter).
    """
    if env is None:  # the OPENRL_* environment through Settings (old names included)
        s = Settings()
        env_seqs, env_loras, env_rank, env_mem = (s.sampler_max_num_seqs, s.vllm_max_loras, s.vllm_max_lora_rank,
                                                  s.sampler_gpu_memory)
        env_args = s.vllm_engine_args or {}
    else:  # an explicit mapping of variable names (tests)
        env_seqs, env_loras, env_rank, env_mem = (_env_value(MAX_NUM_SEQS_ENV, env), _env_value(MAX_LORAS_ENV, env),
                                                  _env_value(MAX_LORA_RANK_ENV, env), _env_value(GPU_MEMORY_ENV, env))
        raw = _env_value(ENGINE_ARGS_ENV, env)
        env_args = json.loads(raw) if raw else {}
        if not isinstance(env_args, dict):
            raise ValueError(f"{ENGINE_ARGS_ENV[0]} must be a JSON object, got {raw!r}")
    if env_args:  # OPENRL_VLLM_ENGINE_ARGS under the explicit engine_kwargs (compilation_config key by key)
        given = dict(engine_kwargs or {})
        cc = {**(env_args.get("compilation_config") or {}), **(given.get("compilation_config") or {})}
        engine_kwargs = {**env_args, **given}
        if cc:
            engine_kwargs["compilation_config"] = cc
    seqs = int(max_batch_rows or env_seqs or DEFAULT_MAX_NUM_SEQS)
    loras = int(max_loras or env_loras or DEFAULT_MAX_LORAS)
    rank = int(max_lora_rank or env_rank or 32)
    mem = float(gpu_memory_utilization or env_mem or DEFAULT_GPU_MEMORY)
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


__all__ = [
    "CUDAGRAPH_SIZES",
    "DEFAULT_GPU_MEMORY",
    "DEFAULT_MAX_LORAS",
    "DEFAULT_MAX_NUM_SEQS",
    "GPU_MEMORY_ENV",
    "MAX_LORAS_ENV",
    "MAX_LORA_RANK_ENV",
    "ENGINE_ARGS_ENV",
    "MAX_NUM_SEQS_ENV",
    "VLLM_LORA_RANKS",
    "capture_sizes",
    "configure_vllm_env",
    "engine_settings",
]
