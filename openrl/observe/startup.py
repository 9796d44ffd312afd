"""Where a function's cold start goes: seconds per start-up phase of this process.

A worker that scales from zero (Knative, or the embedded stack's ``--idle-timeout``) answers its
first request only after the interpreter started, the function loaded its base model and, on a
GPU, compiled its kernels (and vLLM captured its CUDA graphs). Each phase is timed where it runs
and kept here, once per process:

| phase | where | what it holds |
|---|---|---|
| ``serve_to_workers`` | ``openrl.transport.embedded`` | the ``openrl serve`` / ``run`` command's start (``openrl.cli.main``, after the interpreter's start and the CLI's import) → its first process spawned (``--model``'s file checks, a model build; its ``AutoConfig`` check runs beside the start since af0bd6b, openrl/cli/model_check.py); in ``<state>/ports.json`` (``startup``) |
| ``process_to_serve`` | ``openrl.transport.worker.serve`` | process start → the worker's entry (interpreter, imports) |
| ``function_start`` | same | ``Function.start()``: storage, registry, preloaded models |
| ``ready`` | same | process start → consuming its JetStream work |
| ``trainer_model_load`` | ``TrainerEngine`` | ``from_pretrained`` (safetensors → host memory) |
| ``trainer_to_device`` | same | base weights → the device |
| ``trainer_kernels`` | same | fused LoRA kernels set up (CUDA only) |
| ``trainer_first_pass`` | same | the first forward(_backward) pass (Triton compile / autotune on CUDA) |
| ``sampler_engine_start`` | ``SamplerEngine`` | the backend up: HF model load, or vLLM's load + torch.compile + CUDA-graph capture |
| ``vllm_import`` | ``VLLMBackend`` | the sampler process's ``import vllm`` (inside ``sampler_engine_start``) |
| ``vllm_engine_core`` | same | ``AsyncLLM.from_engine_args``: the engine-core process spawned and ready (inside ``sampler_engine_start``) |
| ``adapter_restore`` | ``functions.trainer.durable`` | the last run-state restore (adapter + AdamW state from storage) |

Read them as the gauge ``openrl_startup_seconds{phase}`` on the worker's ``/metrics`` and in
one log line per phase (``start-up phase <name>: <s>s``). Units: seconds (float).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Iterator

from prometheus_client import Gauge

log = logging.getLogger("openrl.startup")

STARTUP_SECONDS = Gauge("openrl_startup_seconds", "Seconds this process spent in each start-up phase "
                        "(openrl.observe.startup)", ["phase"])

_PHASES: dict[str, float] = {}


def process_age_s() -> float | None:
    """Seconds since this process was created (Linux ``/proc``), or None where unknown.

    Source: proc(5): field 22 of ``/proc/self/stat`` is the start time in clock ticks after
    boot; ``btime`` in ``/proc/stat`` is the boot time in seconds since the epoch.
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 overall; fields[0] is field 3 (state)
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return max(0.0, time.time() - (btime + start_ticks / os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def record(phase: str, seconds: float | None) -> None:
    """Keep ``seconds`` as the time of ``phase`` (the last value wins), export it, log it."""
    if seconds is None:
        return
    _PHASES[phase] = float(seconds)
    STARTUP_SECONDS.labels(phase=phase).set(float(seconds))
    log.info("start-up phase %s: %.2fs", phase, seconds)


@contextmanager
def timed(phase: str) -> Iterator[None]:
    """Time the block as ``phase`` (recorded also when the block raises)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        record(phase, time.perf_counter() - t0)


def first(phase: str) -> bool:
    """True until ``phase`` has been recorded in this process (e.g. to time only a first pass)."""
    return phase not in _PHASES


def phases() -> dict[str, float]:
    """The phases recorded so far, ``{phase: seconds}``."""
    return dict(_PHASES)
