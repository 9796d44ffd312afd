"""The sampler Function: a CloudEvent handler for ``sample`` (and compute_logprobs,
which the SDK sends as a sample with ``prompt_logprobs``).

Stateless apart from caches: every event names its base model and, optionally, the
immutable ``tinker://`` snapshot to apply; snapshots are fetched from storage and kept
in an LRU cache of loaded adapters. Concurrent requests share batched decode passes
inside :class:`functions.sampler.engine.SamplerEngine`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from openrl.config import Settings
from openrl.contract import events, payloads
from openrl.contract.function import ALIVE, READY, Status
from openrl.contract.topology import SOURCE_SAMPLER

from openrl.observe import metrics, startup

from openrl.edge import proto
from openrl.model.loadfailures import LoadFailures, ModelLoadError, describe_failures
from openrl.model.registry import ModelRegistry
from openrl.storage import TinkerPath, open_storage
from openrl.storage.handoff import SnapshotHandoff
from openrl.storage import compile_cache
from functions.sampler.compile_sync import CompileCacheSync

SOURCE = SOURCE_SAMPLER


class SamplerFunction:
    """The sampler as a :class:`openrl.contract.function.Function`: ``start`` / ``handle`` /
    ``stop`` / ``alive`` / ``ready`` (the Knative Functions "instanced" shape)."""

    def __init__(self):
        self.engines: dict[str, object] = {}
        self._ready = False
        self._engine_lock = asyncio.Lock()
        self.stability = None  # StabilityStore (openrl/transport/stability.py)
        self.nats_url: str | None = None
        self.load_failures = LoadFailures()  # base models that failed to load (openrl/model/loadfailures.py)
        self.handoff: SnapshotHandoff | None = None
        self._pinning: dict[str, int] = {}  # snapshot key -> requests pinning / loading it now
        self._pin_lock = asyncio.Lock()  # SnapshotHandoff.pin vs unpin_except
        self._unpin: asyncio.Task | None = None
        self.compile_cache = CompileCacheSync(None, "cpu", False)  # set by start()

    async def start(self, cfg: Settings | dict | None = None) -> None:
        """Open storage and the registry; load the ``preload`` base models.

        Args:
            cfg: :class:`openrl.config.Settings` (or a dict of explicit values over the
                environment, :meth:`Settings.of`; a dict may also carry ``registry_obj``, a
                ready :class:`ModelRegistry`, and ``stability_store``, a ready
                :class:`openrl.transport.stability.StabilityStore`). Read: ``nats_url`` (the
                stability store, connected when a request first sets
                ``record_stability_info``), ``storage_url`` (snapshots cached under ``cache_dir``), ``registry_path`` / ``models_path``, ``device`` (auto | cpu |
                cuda[:N], default auto = CUDA when available, see :mod:`openrl.model.device`),
                ``sampler_backend`` (auto | hf | vllm; auto = vLLM on CUDA when installed),
                ``preload`` (base-model names to load now; one that fails to load does not stop the
                sampler: its requests fail, :mod:`openrl.model.loadfailures`), ``model_retry_s``.
                Base weights load in the registry entry's dtype (bf16 on CUDA, float32 on CPU by
                default).

        Raises:
            ValueError: a setting out of range, an unknown device, or a CUDA device where torch
                sees none.
        """
        from openrl.model.device import resolve_device
        from openrl.model.runtime import configure_torch_threads

        registry = cfg.get("registry_obj") if isinstance(cfg, dict) else None
        self.stability = cfg.get("stability_store") if isinstance(cfg, dict) else None
        cfg = Settings.of(cfg)
        self.nats_url = cfg.nats_url  # the stability store's (record_stability_info), opened on first use
        configure_torch_threads(cfg.torch_threads)
        self.storage = open_storage(cfg.storage_url, cache_dir=cfg.cache_dir)
        self.handoff = SnapshotHandoff.from_settings(cfg)  # the co-located trainer's snapshots in memory
        if self.handoff is not None:
            self.handoff.drop_dead_pins()
        self.registry = registry or ModelRegistry.load(cfg.registry_path, models_dir=cfg.models_path)
        self.device = resolve_device(cfg.device)
        self.backend = cfg.sampler_backend
        self.deterministic = cfg.deterministic  # a registry entry's `deterministic` overrides it per model
        self.compile_cache = CompileCacheSync(self.storage, self.device,
                                              compile_cache.enabled(cfg.compile_cache_sync, cfg.storage_url))
        self.load_failures = LoadFailures(cfg.model_retry_s)
        for name in cfg.preload:
            try:
                await self._engine(name)
            except ModelLoadError:  # kept and logged: the model's requests fail with it, the others run
                pass
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        for e in self.engines.values():
            await e.close()
        if self.stability is not None:
            await self.stability.close()

    async def sleep(self) -> bool:
        """Give the GPU back while idle (:mod:`openrl.transport.bindings.idle_sleep`): every loaded
        engine sleeps (transformers: weights to host memory; vLLM: its sleep mode, level 1). The
        binding calls it only with no request in flight; False (declined) while an engine still
        runs a job or loads. Engines that slept before one declined are woken again.

        Raises:
            ServerError: an engine whose backend cannot sleep.
        """
        from functions.sampler.backends.common import sleep_together

        if self._engine_lock.locked():
            return False
        async with self._engine_lock:
            return await sleep_together(list(self.engines.values()))

    async def wake(self) -> None:
        """Wake every engine (the first request after a sleep waits for it)."""
        async with self._engine_lock:
            for e in list(self.engines.values()):
                await e.wake()

    def describe(self) -> dict:
        """What ``openrl status`` shows of this worker: device, base-weight dtype(s), backend
        ("pending" until the first base model is loaded; ``vllm+hf`` once the vLLM backend
        routed a job to transformers), and with vLLM ``unembed`` (the lm_head LoRA mode and its
        check), ``routed`` (jobs sent to transformers, by reason) and ``fallback_error``."""
        from openrl.model.device import dtype_name

        engines = list(self.engines.values())
        dtypes = sorted({dtype_name(e.dtype) for e in engines if getattr(e, "dtype", None) is not None})
        backends = sorted({getattr(e.backend, "name", None) or type(e.backend).__name__.removesuffix("Backend").lower()
                           for e in engines})
        out = {"device": self.device, "dtype": ",".join(dtypes) or "pending",
               "backend": ",".join(backends) or (self.backend if self.backend != "auto" else "pending")}
        for e in engines:  # the vLLM backend's unembedding LoRA mode and the jobs it routed elsewhere
            info = getattr(e.backend, "describe", lambda: {})()
            if "unembed_check" in info:
                out["unembed"] = f"{info['unembed_lora']}: {info['unembed_check']}"
            if info.get("routed"):
                out["routed"] = ", ".join(f"{k}: {v}" for k, v in sorted(info["routed"].items()))
            if info.get("secondary_error"):
                out["fallback_error"] = info["secondary_error"]
        modes = {bool(getattr(e, "deterministic", False)) for e in engines}
        if getattr(self, "deterministic", False) or True in modes:  # issue 33; per model when the registry mixes
            out["deterministic"] = "on" if modes <= {True} else "mixed"
        cc = self.compile_cache.describe()  # OPENRL_COMPILE_CACHE_SYNC
        if cc:
            out["compile_cache"] = cc
        failed = describe_failures(self.load_failures)
        if failed:
            out["models_failed"] = failed
        return out

    def alive(self) -> Status:
        """Always ``(True, "Alive")``."""
        return ALIVE

    def ready(self) -> Status:
        """``(True, "Ready")`` between the end of ``start()`` and the beginning of ``stop()``."""
        return READY if self._ready else (False, "not ready: starting (loading base models) or stopping")

    async def _engine(self, base_model: str):
        """The engine of ``base_model``, loaded on first use (one load at a time).

        Raises:
            ModelLoadError: the model's directory does not load (now, or at a recent attempt that
                :attr:`load_failures` keeps); only this model's requests fail.
        """
        from functions.sampler.engine import SamplerEngine

        from openrl.model.device import resolve_dtype

        entry = self.registry.resolve(base_model)
        key = str(entry.path)
        async with self._engine_lock:
            if key not in self.engines:
                self.load_failures.check(base_model, key)
                dtype = resolve_dtype(getattr(entry, "dtype", None), self.device)
                await self.compile_cache.restore_once()  # OPENRL_COMPILE_CACHE_SYNC: caches from storage
                try:
                    with startup.timed("sampler_engine_start"):  # vLLM: load + torch.compile + CUDA graphs
                        engine = await asyncio.to_thread(
                            SamplerEngine, Path(entry.path), device=self.device, dtype=dtype, backend=self.backend,
                            deterministic=entry.is_deterministic(getattr(self, "deterministic", False)))
                except Exception as exc:  # noqa: BLE001 - any load error fails this model only
                    raise self.load_failures.record(base_model, key, exc) from exc
                engine.dtype = dtype
                self.engines[key] = engine
                self.compile_cache.save_soon()
        return self.engines[key]

    async def handle(self, event):
        """Sample; the result is a protobuf ``SampleResponse``. With ``record_stability_info``
        each returned sequence is recorded first (:func:`stability_records`), for
        ``stable_reinforce`` training.

        Raises:
            UserError: bad sampling parameters or an unknown snapshot (category "user").
        """
        d = payloads.Sample.parse(events.data_json(event))
        engine = await self._engine(d.base_model)
        adapter = adapter_dir = None
        busy = metrics.busy_clock("sampler")  # openrl_busy_seconds_total: adapter load + sampling
        if d.model_path:
            ckpt = TinkerPath.parse(d.model_path, field="model_path")
            adapter = str(ckpt)
            self._pinning[adapter] = self._pinning.get(adapter, 0) + 1  # no unpin drops it meanwhile
        try:
            if adapter is not None:
                adapter_dir = await self._adapter_dir(ckpt)
            return await self._sample(event, d, engine, adapter, adapter_dir, busy)
        finally:
            if adapter is not None:
                self._pinning[adapter] -= 1
                if not self._pinning[adapter]:
                    del self._pinning[adapter]
                if self.handoff is not None and (self._unpin is None or self._unpin.done()):
                    self._unpin = asyncio.get_running_loop().create_task(self._unpin_unused())  # off the answer's path

    async def _sample(self, event, d: payloads.Sample, engine, adapter: str | None, adapter_dir: Path | None,
                      busy) -> object:
        """Run ``d`` on ``engine`` (the payload is the job; its ``model_path`` becomes ``adapter``, the
        snapshot's normalised path and adapter key, loaded from ``adapter_dir`` when it is not
        loaded, atomically with pinning it for this job) and build the result event."""
        job = d if adapter is None else d.model_copy(update={"model_path": adapter})  # the adapter key
        t0 = time.perf_counter()
        with busy.job():
            res = await engine.sample(job, adapter_dir=adapter_dir)
        # usage: generated tokens and engine seconds per owner (concurrent jobs share decode
        # passes, so their seconds overlap)
        metrics.record_sampled(event.get_extension("owner"), sum(len(s.tokens) for s in res.sequences),
                               time.perf_counter() - t0, prompt_tokens=len(d.prompt_tokens))
        if d.record_stability_info:  # before the result: a client never holds an id without its record
            await self._stability().put_many(stability_records(event, d, res))
        return events.result_event(event, encode_result(res, d.target_prompt_logprobs), source=SOURCE)

    async def _unpin_unused(self) -> None:
        """Drop the handoff pins of adapters no engine holds or is loading (under the lock that
        :meth:`_adapter_dir` pins with, so what to keep is read when nothing pins)."""
        async with self._pin_lock:
            keep = {k for e in self.engines.values() for k in e.loaded_adapters()} | set(self._pinning)
            await asyncio.to_thread(self.handoff.unpin_except, keep)

    async def _adapter_dir(self, ckpt: TinkerPath) -> Path:
        """The directory to load snapshot ``ckpt`` from: the handoff's (:mod:`openrl.storage.
        handoff`, the co-located trainer's copy in shared memory, pinned for this process:
        :meth:`SnapshotHandoff.pin`) when it is there, else storage's.

        Raises:
            NotFound: no checkpoint at ``ckpt``.
        """
        held = None
        if self.handoff is not None:
            async with self._pin_lock:  # an unpin in flight cannot remove the pin this returns
                held = await asyncio.to_thread(self.handoff.pin, ckpt)
        if held is not None:
            metrics.SNAPSHOT_SOURCE.labels("handoff").inc()
            return held
        local = await asyncio.to_thread(self.storage.get_dir, ckpt)
        metrics.SNAPSHOT_SOURCE.labels("storage").inc()
        return local

    def _stability(self):
        if self.stability is None:
            from openrl.transport.stability import StabilityStore

            self.stability = StabilityStore(self.nats_url)
        return self.stability


def stability_records(event, d: payloads.Sample, res) -> dict:
    """``sequence_id -> SequenceRecord`` of each sequence of a sample result: its tokens and
    sampler logprobs, the prompt length, the owner (the event's ``owner`` extension) and the client
    session of the sampling session (:mod:`openrl.contract.stability`). The ids are those the
    gateway returned in the future's ``sample_sequence_ids`` (event id = request id)."""
    from openrl.contract.stability import SequenceRecord, sequence_ids, session_of

    sid = d.sampling_session_id or event.get_subject()
    now = time.time()
    return {seq_id: SequenceRecord(owner=event.get_extension("owner"), session_id=session_of(sid) or sid,
                                   sampler_id=sid, prompt_len=len(d.prompt_tokens),
                                   tokens=np.asarray(s.tokens, dtype=np.int64),
                                   logprobs=np.asarray(s.logprobs, dtype=np.float32), used_at=now)
            for seq_id, s in zip(sequence_ids(event.get_id(), len(res.sequences)), res.sequences)}


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
