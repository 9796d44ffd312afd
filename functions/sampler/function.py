"""The sampler Function: a CloudEvent handler for ``sample`` (and compute_logprobs,
which the SDK sends as a sample with ``prompt_logprobs``).

Stateless apart from caches: every event names its base model and, optionally, the
immutable ``tinker://`` snapshot to apply; snapshots are fetched from storage and kept
in an LRU cache of loaded adapters. Concurrent requests share batched decode passes
inside :class:`functions.sampler.engine.SamplerEngine`.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np

from openrl.contract import events

from openrl.observe import metrics

from openrl.edge import proto
from openrl.errors import UserError
from openrl.model.registry import ModelRegistry
from openrl.storage import TinkerPath, open_storage

SOURCE = "/openrl/sampler"


class SamplerFunction:
    """Knative Functions "instanced" shape: ``start`` / ``handle`` / ``stop`` / ``alive`` / ``ready``."""

    def __init__(self):
        self.engines: dict[str, object] = {}
        self._ready = False
        self._engine_lock = asyncio.Lock()

    async def start(self, cfg: dict) -> None:
        """cfg keys (env fallbacks): ``storage`` (OPENRL_STORAGE), ``models_dir``, ``registry``
        (OPENRL_MODEL_REGISTRY), ``device`` (OPENRL_DEVICE: auto | cpu | cuda[:N], default auto =
        CUDA when available, see :mod:`openrl.model.device`), ``backend`` (OPENRL_SAMPLER_BACKEND:
        auto | hf | vllm; auto = vLLM on CUDA when installed), ``preload`` (base-model names to
        load now). Base weights load in the registry entry's dtype (bf16 on CUDA, float32 on CPU
        by default).

        Raises:
            ValueError: an unknown device, or a CUDA device where torch sees none.
        """
        from openrl.model.device import resolve_device
        from openrl.model.runtime import configure_torch_threads

        configure_torch_threads()
        home = Path(os.environ.get("OPENRL_HOME", str(Path.home() / ".openrl")))
        self.storage = open_storage(cfg.get("storage") or os.environ.get("OPENRL_STORAGE", (home / "storage").as_uri()),
                                    cache_dir=home / "cache")
        reg = cfg.get("registry") or os.environ.get("OPENRL_MODEL_REGISTRY")
        self.registry = cfg.get("registry_obj") or ModelRegistry.load(
            Path(reg) if reg else None, models_dir=Path(cfg.get("models_dir") or home / "models"))
        self.device = resolve_device(cfg.get("device"))
        self.backend = cfg.get("backend") or os.environ.get("OPENRL_SAMPLER_BACKEND", "auto")
        for name in cfg.get("preload") or [n for n in os.environ.get("OPENRL_PRELOAD", "").split(",") if n.strip()]:
            await self._engine(name)
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        for e in self.engines.values():
            await e.close()

    def describe(self) -> dict:
        """What ``openrl status`` shows of this worker: device, base-weight dtype(s), backend
        ("pending" until the first base model is loaded)."""
        from openrl.model.device import dtype_name

        engines = list(self.engines.values())
        dtypes = sorted({dtype_name(e.dtype) for e in engines if getattr(e, "dtype", None) is not None})
        backends = sorted({type(e.backend).__name__.removesuffix("Backend").lower() for e in engines})
        return {"device": self.device, "dtype": ",".join(dtypes) or "pending",
                "backend": ",".join(backends) or (self.backend if self.backend != "auto" else "pending")}

    def alive(self) -> bool:
        return True

    def ready(self) -> bool:
        return self._ready

    async def _engine(self, base_model: str):
        from functions.sampler.engine import SamplerEngine

        from openrl.model.device import resolve_dtype

        entry = self.registry.resolve(base_model)
        key = str(entry.path)
        async with self._engine_lock:
            if key not in self.engines:
                dtype = resolve_dtype(getattr(entry, "dtype", None), self.device)
                engine = await asyncio.to_thread(
                    SamplerEngine, Path(entry.path), device=self.device, dtype=dtype, backend=self.backend)
                engine.dtype = dtype
                self.engines[key] = engine
        return self.engines[key]

    async def handle(self, event):
        """Sample; the result is a protobuf ``SampleResponse``.

        Raises:
            UserError: bad sampling parameters or an unknown snapshot (category "user").
        """
        from functions.sampler.engine import SampleJob

        d = events.data_json(event)
        engine = await self._engine(d["base_model"])
        adapter = None
        if d.get("model_path"):
            ckpt = TinkerPath.parse(d["model_path"], field="model_path")
            local = await asyncio.to_thread(self.storage.get_dir, ckpt)
            adapter = str(ckpt)
            await engine.ensure_adapter(adapter, local)
        sp = d.get("sampling_params") or {}
        stop = sp.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        tpl = d.get("target_prompt_logprobs")
        job = SampleJob(
            prompt=list(d["prompt_tokens"]),
            num_samples=int(d.get("num_samples", 1)),
            max_tokens=sp.get("max_tokens"),
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            top_k=int(sp.get("top_k", -1)),
            seed=sp.get("seed"),
            stop=stop,
            prompt_logprobs=bool(d.get("prompt_logprobs")),
            topk_prompt_logprobs=int(d.get("topk_prompt_logprobs") or 0),
            topk_sample_logprobs=int(d.get("topk_sample_logprobs") or 0),
            prompt_logprobs_last_n=d.get("prompt_logprobs_last_n"),
            adapter=adapter,
            target_prompt_ids=target_rows(tpl) if tpl else None,
            prompt_alt_tokens_k=int(d.get("prompt_alt_tokens_k") or 0),
        )
        t0 = time.perf_counter()
        res = await engine.sample(job)
        # usage: generated tokens and engine seconds per owner (concurrent jobs share decode
        # passes, so their seconds overlap)
        metrics.record_sampled(event.get_extension("owner"), sum(len(s.tokens) for s in res.sequences),
                               time.perf_counter() - t0)
        return events.result_event(event, encode_result(res, tpl), source=SOURCE)


def target_rows(td: dict) -> list[list[int]]:
    """A JSON TensorData of int64 target ids ``[P-1, K]`` (dense or CSR, -1 = unused) as rows.

    Raises:
        UserError: the tensor is not 2-D or its CSR indices do not fit its shape.
    """
    shape = td.get("shape") or []
    if len(shape) != 2:
        raise UserError("target_prompt_logprobs", f"expected shape [len(prompt)-1, K], got {shape}")
    rows, k = int(shape[0]), int(shape[1])
    data = [int(x) for x in td.get("data") or []]
    if td.get("sparse_crow_indices") is not None:
        crow, col = td["sparse_crow_indices"], td.get("sparse_col_indices") or []
        if len(crow) != rows + 1 or len(col) != len(data) or (col and max(col) >= k):
            raise UserError("target_prompt_logprobs", "CSR indices do not match the shape")
        dense = [[-1] * k for _ in range(rows)]
        for r in range(rows):
            for j in range(crow[r], crow[r + 1]):
                dense[r][col[j]] = data[j]
        return dense
    if len(data) != rows * k:
        raise UserError("target_prompt_logprobs", f"{len(data)} values for shape {shape}")
    return [data[r * k:(r + 1) * k] for r in range(rows)]


def encode_result(res, tpl: dict | None) -> bytes:
    """A :class:`SampleResult` as the protobuf ``SampleResponse`` the SDK decodes."""
    seqs = [proto.SampledSeq(tokens=s.tokens, logprobs=s.logprobs, stop_reason=s.stop_reason, topk=s.topk)
            for s in res.sequences]
    csr = None
    if tpl and tpl.get("sparse_crow_indices") is not None:
        csr = (tpl["sparse_crow_indices"], tpl["sparse_col_indices"])
    return proto.encode_sample_response(
        seqs,
        prompt_logprobs=res.prompt_logprobs,
        topk_prompt_logprobs=res.topk_prompt,
        target_prompt_logprobs=(np.asarray(res.target_prompt_logprobs, dtype=np.float32)
                                if res.target_prompt_logprobs is not None else None),
        target_prompt_logprobs_csr=csr,
        prompt_alt_tokens=res.prompt_alt_tokens,
    )
