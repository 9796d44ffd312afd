"""The trainer Function: a CloudEvent handler for create_model, forward(_backward),
optim_step, save_weights(_for_sampler), load_weights and unload_model.

It holds one frozen base model per base-model directory (a :class:`TrainerEngine`) and,
per training run, a LoRA adapter with its AdamW state. Requests of one run execute in
seq_id order; ready forward(_backward) requests of several runs on the same base model
share one pass (see :mod:`functions.trainer.scheduler`).

Durability (see :mod:`functions.trainer.durable`): ``stop()`` flushes every changed run's
adapter, optimizer state, gradients and seq_id cursor to storage, a periodic task flushes
changed runs every ``OPENRL_FLUSH_INTERVAL_S`` seconds, and a trainer that does not hold a
run restores it from storage on the run's first request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path

from openrl import testhooks

from openrl.config import Settings
from openrl.contract import events, payloads
from openrl.contract.function import ALIVE, READY, Status
from openrl.contract.ops import Op
from openrl.contract.topology import SOURCE_TRAINER

from openrl.edge import proto
from openrl.errors import NotFound, ServerError, UserError
from openrl.model.loadfailures import LoadFailures, ModelLoadError, describe_failures
from openrl.model.registry import ModelRegistry
from openrl.storage import CheckpointExists, TinkerPath, build_manifest, open_storage

from functions.trainer.durable import RunDurability
from functions.trainer.pass_window import PassWindow
from functions.trainer.runs import RunTable
from functions.trainer.scheduler import PackPolicy, Pending, Scheduler, Work, run_works
from functions.trainer.snapshots import SnapshotWriter
from openrl.storage.handoff import SnapshotHandoff

SOURCE = SOURCE_TRAINER
log = logging.getLogger("openrl.trainer")


class TrainerFunction:
    """The trainer as a :class:`openrl.contract.function.Function`: ``start`` / ``handle`` /
    ``stop`` / ``alive`` / ``ready`` (the Knative Functions "instanced" shape).

    Attributes:
        engines: base-model directory -> ``TrainerEngine``.
        runs: the :class:`~functions.trainer.runs.RunTable` of the runs held here (given to
            the scheduler's grouping and to :class:`RunDurability`).
    """

    def __init__(self):
        self.engines: dict[str, object] = {}  # base-model dir -> TrainerEngine
        self.runs = RunTable()  # model_id -> base-model dir, metadata, owner
        self._ready = False
        self._stopping = False
        self._lock = asyncio.Lock()  # one engine computation at a time (one device)
        self.window = PassWindow(self._lock, enabled=False)  # start() sets it from the settings
        self.durable: RunDurability | None = None
        self.stability = None  # StabilityStore of stable_reinforce (openrl/transport/stability.py)
        self.nats_url: str | None = None
        self.load_failures = LoadFailures()  # base models that failed to load (openrl/model/loadfailures.py)
        self.snapshots: SnapshotWriter | None = None  # unnamed sampler snapshots through memory (one machine)
        self._work: asyncio.Task | None = None  # the one loop: scheduler.next_work -> _execute -> finish

    async def start(self, cfg: Settings | dict | None = None) -> None:
        """Open storage and the registry, start the scheduler and the run-state flusher,
        load the ``preload`` base models.

        Args:
            cfg: :class:`openrl.config.Settings` (or a dict of explicit values over the
                environment, :meth:`Settings.of`; a dict may also carry ``registry_obj``, a
                ready :class:`ModelRegistry`, and ``stability_store``, a ready
                :class:`openrl.transport.stability.StabilityStore`). Read: ``nats_url`` (the
                stability store of ``stable_reinforce``, connected on first use), ``storage_url``, ``registry_path`` /
                ``models_path``, ``device`` (auto | cpu | cuda[:N], see :mod:`openrl.model.device`;
                base weights load in the registry entry's dtype, bf16 on CUDA and float32 on CPU
                by default), ``trainer_gpu_memory`` (the fraction of the GPU's memory this
                process may allocate, for a GPU shared with a sampler; None = all),
                ``pack_max_delay_s`` (see :class:`PackPolicy`), ``seq_gap_timeout_s``,
                ``max_seq_ahead`` (seq_ids more than this past a run's next one fail with
                category "user"), ``preload`` (a model that fails to load there does not stop the
                trainer: its requests fail, :mod:`openrl.model.loadfailures`), ``model_retry_s``,
                ``flush_interval_s``, ``restore_wait_s``, ``trainer_gpus`` (> 1: each
                base model's engine spans that many ranks, :func:`functions.trainer.distributed.launch`).

        Raises:
            ValueError: a setting out of range (pydantic.ValidationError), an unknown device, or
                a GPU memory fraction outside (0, 1].
        """
        from openrl.model.device import resolve_device
        from openrl.model.runtime import configure_torch_threads

        registry = cfg.get("registry_obj") if isinstance(cfg, dict) else None
        self.stability = cfg.get("stability_store") if isinstance(cfg, dict) else None
        cfg = Settings.of(cfg)
        configure_torch_threads(cfg.torch_threads)
        self.nats_url = cfg.nats_url  # the stability store's (stable_reinforce), opened on first use
        # a co-located sampler (the embedded stack) reads gs:// snapshots from the shared cache
        self.storage = open_storage(cfg.storage_url, cache_dir=cfg.cache_dir, write_through=cfg.colocated_sampler)
        handoff = SnapshotHandoff.from_settings(cfg)  # unnamed sampler snapshots through memory (one machine)
        self.window = PassWindow(self._lock, enabled=cfg.pack_beside_pass)  # snapshot packs beside a pass
        self.snapshots = SnapshotWriter(handoff, self.storage, self.window,
                                        staged=cfg.handoff_staged, writers=cfg.handoff_writers,
                                        spares=cfg.handoff_spares) if handoff is not None else None
        self.registry = registry or ModelRegistry.load(cfg.registry_path, models_dir=cfg.models_path)
        self.device = resolve_device(cfg.device)
        self.fused_kernels = cfg.fused_kernels
        self.deterministic = cfg.deterministic  # a registry entry's `deterministic` overrides it per model
        self.load_failures = LoadFailures(cfg.model_retry_s)
        self.trainer_gpus = cfg.trainer_gpus  # > 1: FSDP2 engine over that many ranks (functions/trainer/distributed.py)
        self._limit_gpu_memory(cfg.trainer_gpu_memory)
        self.scheduler = Scheduler(
            self.runs, gap_timeout_s=cfg.seq_gap_timeout_s, max_ahead=cfg.max_seq_ahead,
            policy=PackPolicy(max_delay_s=cfg.pack_max_delay_s),
            snapshots_beside=cfg.pack_beside_pass and handoff is not None and cfg.handoff_staged,
            pass_token_budget=cfg.pass_token_budget,  # fair share per API key
        )
        self.durable = RunDurability(self.storage, self.runs, self.scheduler.cursor, engines=self.engines,
                                     load_engine=self._engine_for, engine_lock=self._lock,
                                     interval_s=cfg.flush_interval_s, restore_wait_s=cfg.restore_wait_s)
        self._work = asyncio.get_running_loop().create_task(run_works(self.scheduler, self._execute))
        self.durable.start()
        if self.snapshots is not None:  # what a previous trainer handed off but did not write
            self._recovery = asyncio.get_running_loop().create_task(self.snapshots.recover())
        for name in cfg.preload:
            try:
                await asyncio.to_thread(self._engine_for, name)
            except ModelLoadError:  # kept and logged: the model's requests fail with it, the others run
                pass
        self._ready = True

    async def stop(self) -> None:
        """Drain and flush: let the engine op in progress finish, stop the scheduler (requests
        still queued are never answered here, so their messages are redelivered to the next
        trainer), then flush every changed run's state to storage (``final``).

        The bindings stop taking new requests and drain those in flight before calling this.
        """
        self._ready = False
        self._stopping = True
        if self.durable is None:  # start() never ran
            return
        await self.durable.stop_periodic()
        async with self._lock:  # the op in progress (if any) completes and updates its cursor first
            if self._work is not None:
                self._work.cancel()
        await self.durable.wait_idle()  # creates / restores / unloads already under way
        if self.snapshots is not None:  # handed-off snapshots reach storage before the process ends
            await self.snapshots.drain()
        await self.durable.flush_all(final=True)
        for engine in self.engines.values():
            if hasattr(engine, "close"):  # a DistributedTrainerEngine: stop its follower ranks
                await asyncio.to_thread(engine.close)
        if self.stability is not None:
            await self.stability.close()

    def _limit_gpu_memory(self, fraction) -> None:
        """Cap this process's CUDA allocations at ``fraction`` of the device (a GPU shared with
        the vLLM sampler: see ``openrl serve --trainer-gpu-memory``); beyond it an allocation
        raises ``torch.cuda.OutOfMemoryError``, which fails that request only."""
        self.gpu_memory = None
        if fraction in (None, "") or not self.device.startswith("cuda"):
            return
        f = float(fraction)
        if not 0 < f <= 1:
            raise ValueError(f"OPENRL_TRAINER_GPU_MEMORY must be a fraction in (0, 1], got {fraction!r}")
        import torch

        dev = torch.device(self.device)
        torch.cuda.set_per_process_memory_fraction(f, dev.index if dev.index is not None else torch.cuda.current_device())
        self.gpu_memory = f

    def describe(self) -> dict:
        """What ``openrl status`` shows of this worker: device, base-weight dtype(s), backend,
        failed models, and on CUDA each fused kernel's state (``kernels``: ``liger``, ``eager``,
        ``failed: ...``, ``failed at run time: ...``; :func:`openrl.model.kernels.kernel_status`)."""
        from openrl.model.device import dtype_name

        dtypes = sorted({dtype_name(e.dtype) for e in self.engines.values()})
        out = {"device": self.device, "dtype": ",".join(dtypes) if dtypes else "pending", "backend": "torch"}
        modes = {bool(getattr(e, "deterministic", False)) for e in self.engines.values()}
        if getattr(self, "deterministic", False) or True in modes:  # issue 33; per model when the registry mixes
            out["deterministic"] = "on" if modes <= {True} else "mixed"
        failed = describe_failures(self.load_failures)
        if failed:
            out["models_failed"] = failed
        if getattr(self, "gpu_memory", None):
            out["gpu_memory"] = str(self.gpu_memory)
        kernels = next((k for e in self.engines.values() if (k := getattr(e, "kernels", None))), None)
        if kernels:  # CUDA with fused kernels: "rms_norm: liger, silu_mul: liger, rope: failed: ..."
            out["kernels"] = ", ".join(f"{n}: {v}" for n, v in kernels.items() if n != "patched")
        return out

    def alive(self) -> Status:
        """Always ``(True, "Alive")``: a trainer that answers at all is alive."""
        return ALIVE

    def ready(self) -> Status:
        """``(True, "Ready")`` between the end of ``start()`` and the beginning of ``stop()``."""
        if self._ready:
            return READY
        return False, ("stopping: draining and flushing run state" if self._stopping
                       else "starting: loading base models")

    # ----- idle sleep (openrl/transport/bindings/idle_sleep.py) ---------------------
    async def sleep(self) -> bool:
        """Give the GPU back while idle: every engine's weights, runs and optimizer state move to
        host memory (:mod:`functions.trainer.residency`), between engine computations (under the
        engine lock). The binding calls it only with no request in flight; False (declined) while
        a snapshot is still being packed or a run is being created, restored or unloaded.

        Raises:
            ServerError: an engine that cannot move (the multi-GPU engine, ``trainer_gpus`` > 1).
        """
        from functions.trainer import residency

        if any(not hasattr(e, "runs") or not hasattr(e, "model") for e in self.engines.values()):
            raise ServerError("idle sleep is not supported by the multi-GPU trainer engine (OPENRL_TRAINER_GPUS > 1)")
        if self._lock.locked() or (self.durable is not None and self.durable.busy()):
            return False
        async with self._lock:
            freed = 0
            for engine in list(self.engines.values()):
                freed += await asyncio.to_thread(residency.offload, engine)
        log.info("asleep: %.2f GB of engine tensors moved to host memory", freed / 1e9)
        return True

    async def wake(self) -> None:
        """Move every engine back to its device (the first request after a sleep waits for it).

        Raises:
            torch.cuda.OutOfMemoryError: the device no longer has room for them (the request fails
                naming it; the next request tries again).
        """
        from functions.trainer import residency

        async with self._lock:
            for engine in list(self.engines.values()):
                await asyncio.to_thread(residency.reload, engine)

    # ----- engines ----------------------------------------------------------------
    _engine_load_lock = threading.Lock()

    def _engine_for(self, base_model: str):
        """Load (once) the engine of a base model; runs in worker threads, so concurrent first
        requests wait for one load (two at once raced in transformers' lazy imports).

        Raises:
            ModelLoadError: the model's directory does not load (now, or at a recent attempt that
                :attr:`load_failures` keeps); only this model's requests fail.
        """
        from functions.trainer.engine import TrainerEngine
        from openrl.model.device import resolve_dtype

        entry = self.registry.resolve(base_model)
        key = str(entry.path)
        with self._engine_load_lock:
            if key not in self.engines:
                dtype = resolve_dtype(getattr(entry, "dtype", None), self.device)
                det = entry.is_deterministic(getattr(self, "deterministic", False))
                if det and getattr(self, "trainer_gpus", 1) > 1:
                    def load():  # the FSDP engine's gradient reductions are not batch-invariant (yet)
                        raise ValueError("the deterministic mode runs on one trainer GPU for now "
                                         "(OPENRL_TRAINER_GPUS=1, or turn the mode off for this model)")
                elif getattr(self, "trainer_gpus", 1) > 1:
                    from functions.trainer.distributed import launch

                    def load():
                        return launch(Path(entry.path), self.trainer_gpus, dtype=dtype,
                                      backend="nccl" if self.device.startswith("cuda") else "gloo",
                                      fused_kernels=self.fused_kernels)
                else:
                    def load():
                        return TrainerEngine(Path(entry.path), device=self.device, dtype=dtype,
                                             fused_kernels=self.fused_kernels, deterministic=det)
                self.engines[key] = self.load_failures.load(base_model, key, load)
        return key

    def _engine(self, model_id: str):
        key = self.runs.base_key(model_id)
        if key is None:
            raise NotFound("model_id", f"training run {model_id!r} is not loaded on this trainer")
        return self.engines[key]

    # ----- the handler ------------------------------------------------------------
    async def handle(self, event):
        """Run one request event; return its result event.

        Raises:
            UserError / NotFound: bad input (becomes a failed future, category "user").
        """
        if self._stopping:  # never answered: the message stays unacked and goes to the next trainer
            await asyncio.Event().wait()
        op = events.op_of(event)
        model_id = event.get_subject()
        if event.get_extension("owner"):  # the gateway's owner id of the run's API key (usage metrics)
            self.runs.set_owner(model_id, str(event.get_extension("owner")))
        if op in payloads.PROTOBUF_OPS:  # the SDK's protobuf body, decoded once here
            fb = proto.decode_forward_backward_request(events.data_bytes(event))
            result = await self._submit(model_id, fb.seq_id, op, fb)
            return None if result is _APPLIED else events.result_event(event, result, source=SOURCE)
        p = payloads.parse_payload(op, events.data_json(event))
        if isinstance(p, payloads.CreateModel) or (isinstance(p, payloads.LoadWeights) and p.create):
            result = await self._create(model_id, p)
        elif op == Op.UNLOAD_MODEL:
            result = await self._unload(model_id)
        else:
            result = await self._submit(model_id, p.seq_id, op, p)
        if op == Op.SKIP or result is _APPLIED:
            return None  # skip: the gateway already answered that call with a 4xx
        return events.result_event(event, result, source=SOURCE)

    async def _submit(self, model_id: str, seq_id: int, op: str, payload):
        """Restore the run if this trainer does not hold it, then run the request in seq_id order.

        Returns the result, or ``_APPLIED`` for a redelivered request that was applied before
        (its result is already in the futures KV; nothing runs again).

        Raises:
            NotFound: the run is neither held here nor stored.
        """
        if model_id not in self.runs and not await self.durable.restore(model_id, seq_id):
            if op == "skip":
                return None
            raise NotFound("model_id", f"training run {model_id!r} is not loaded on this trainer")
        if self.scheduler.cursor.applied_without_result(model_id, seq_id):
            return _APPLIED
        self.durable.begin(model_id, seq_id)
        try:
            return await self.scheduler.submit(model_id, seq_id, op, payload)
        finally:
            self.durable.end(model_id, seq_id)

    async def _create(self, model_id: str, p: payloads.CreateModel | payloads.LoadWeights) -> dict:
        """A new run: ``create_model``, or create-via-load (``load_weights`` with ``create``)."""
        async with self.durable.run_lock(model_id):
            if model_id in self.runs or await self.durable._restore_locked(model_id, None):
                # a redelivered create: already applied (here, or by a trainer that flushed it)
                if isinstance(p, payloads.LoadWeights):
                    return {"model_id": model_id, "path": p.path}
                return {"model_id": model_id, "type": "create_model"}
            result = await self._create_locked(model_id, p)
        if self.durable.interval_s > 0:
            # with periodic flushes on, a run is restorable from its creation: a trainer crash
            # before the first periodic flush then restores it at cursor 1 (and its later
            # requests fail with category "server", see RunCursor.gap_error) instead of "not loaded"
            try:
                await self.durable.flush_run(model_id)
            except Exception:  # noqa: BLE001 - the periodic flush retries; the create itself succeeded
                log.exception("run state of %s not flushed at creation", model_id)
        return result

    async def _create_locked(self, model_id: str, p: payloads.CreateModel | payloads.LoadWeights) -> dict:
        from functions.trainer.durable import lora_spec

        lora = p.lora_config.to_data()  # the keys the gateway sent: run metadata and manifests keep them
        load = p if isinstance(p, payloads.LoadWeights) else None
        key = await asyncio.to_thread(self._engine_for, p.base_model)
        engine = self.engines[key]
        spec = lora_spec(lora)
        # the adapter's init and host-to-device copy outside the engine lock (the run lock keeps
        # idle sleep out meanwhile): packed passes of other runs go on while a run is created
        prepared = await asyncio.to_thread(engine.prepare_run, spec)
        async with self._lock:
            if load is not None and load.path:
                ckpt = TinkerPath.parse(load.path)
                src = await asyncio.to_thread(self.storage.get_dir, ckpt)
                await asyncio.to_thread(engine.create_run, model_id, spec, prepared)
                await asyncio.to_thread(engine.load_state, model_id, src, load.optimizer, spec)
            else:
                await asyncio.to_thread(engine.create_run, model_id, spec, prepared)
        self.runs.add(model_id, key, {"base_model": p.base_model, "lora_config": lora,
                                      "optimizer_config": p.optimizer_config})
        self.scheduler.reset(model_id, 1)
        if load is not None:
            return {"model_id": model_id, "path": load.path}
        return {"model_id": model_id, "type": "create_model"}

    async def _unload(self, model_id: str) -> dict:
        async with self.durable.run_lock(model_id):
            info = self.runs.remove(model_id)
            key = info.base_key if info is not None else None
            if key is not None:
                async with self._lock:
                    await asyncio.to_thread(self.engines[key].delete_run, model_id)
            self.scheduler.forget(model_id)
            await self.durable.forget(model_id)  # an unloaded run is not restored
        return {"model_id": model_id, "type": "unload_model"}

    def _account(self, items: list[Pending], seconds: float) -> None:
        """Usage metrics of one scheduler work: tokens per op and device seconds per owner.
        Never raises: metrics never fail a request."""
        from openrl.observe import metrics

        try:
            work = [(self.runs.owner(p.model_id), p.op,
                     sum(len(d.tokens) for d in p.payload.data) if p.op in ("forward", "forward_backward") else 0)
                    for p in items]
            metrics.record_trained(work, seconds)
        except Exception:  # noqa: BLE001
            log.exception("usage accounting failed")

    # ----- execution (the one loop: scheduler.next_work -> _execute -> scheduler.finish) ------
    async def _execute(self, work: Work) -> list:
        """Run one :class:`~functions.trainer.scheduler.Work` (its requests are each run's next in
        seq_id order) and account its device time; results align with ``work.items`` (an
        exception per failed request).

        - "pass": one packed forward(_backward) pass (:meth:`_run_packed`), traced as the
          ``trainer pass`` span;
        - "optims": one fused optimizer update of several runs (:meth:`_run_optims`);
        - "singles": the heads of different runs, concurrently (their engine work is
          serialised by the engine lock, their I/O overlaps), each accounted on its own;
        - "snapshots": sampler saves, as "singles"; :func:`run_works` runs them beside the works
          after them (their packs ride a pass's :class:`PassWindow`).
        """
        from openrl.observe import metrics, tracing

        busy = metrics.busy_clock("trainer")
        if work.kind in ("singles", "snapshots"):
            async def one(p: Pending):
                t0 = time.perf_counter()
                try:
                    with busy.job():  # openrl_busy_seconds_total
                        return await self._run_single(p)
                except Exception as exc:  # noqa: BLE001 - the failure belongs to this request
                    return exc
                finally:
                    self._account([p], time.perf_counter() - t0)

            return list(await asyncio.gather(*(one(p) for p in work.items)))
        t0 = time.perf_counter()
        try:
            if work.kind == "optims":
                with busy.job():
                    return await self._run_optims(work.items)
            items = work.items
            with tracing.span("trainer pass", attributes={
                    "openrl.pass.index": work.index, "openrl.pass.runs": work.runs,
                    "openrl.pass.tokens": sum(p.tokens for p in items),
                    "openrl.pass.items": json.dumps([[p.model_id, p.seq_id, p.after_pass, p.tokens,
                                                      self.scheduler.owner_key(p.model_id)]
                                                     for p in items[:512]])}):
                with busy.job():
                    return await self._run_packed(items)
        finally:
            self._account(work.items, time.perf_counter() - t0)

    async def _run_packed(self, items: list[Pending]) -> list:
        """Ready forward(_backward) requests of one base model: stable_reinforce ones first get
        their recorded sampler logprobs (a request whose provenance does not resolve fails alone
        with category "user"), then all run as one pass (:meth:`_run_resolved`)."""
        from functions.trainer import stability

        failed = {}
        for k, p in enumerate(items):
            if p.payload.loss_fn == stability.LOSS:
                try:
                    await stability.resolve_request(self._stability(), p.payload, model_id=p.model_id,
                                                    owner=self.runs.owner(p.model_id))
                except UserError as e:
                    failed[k] = e
        rest = [p for k, p in enumerate(items) if k not in failed]
        done = iter(await self._run_resolved(rest) if rest else [])
        return [failed[k] if k in failed else next(done) for k in range(len(items))]

    def _stability(self):
        if self.stability is None:
            from openrl.transport.stability import StabilityStore

            self.stability = StabilityStore(self.nats_url)
        return self.stability

    async def _run_resolved(self, items: list[Pending]) -> list:
        from functions.trainer.engine import Datum, FwdBwdItem

        engine = self._engine(items[0].model_id)
        work = []
        for p in items:
            fb = p.payload
            work.append(FwdBwdItem(
                model_id=p.model_id,
                datums=[Datum(tokens=list(d.tokens), loss_fn_inputs=dict(d.loss_fn_inputs)) for d in fb.data],
                loss_fn=fb.loss_fn, loss_fn_config=dict(fb.loss_fn_config), forward_only=(p.op == "forward"),
            ))
        async with self._lock:
            async with self.window.open(engine):  # unnamed snapshots of other runs pack meanwhile
                results = await asyncio.to_thread(engine.forward_backward, work)
            if testhooks.enabled():  # tests only: hold with the pass applied, cursor not moved
                await asyncio.to_thread(testhooks.hold, "computed:forward_backward")
        out = []
        for p, r in zip(items, results):
            if r.error is not None:
                out.append(r.error)
            else:
                if r.mismatch is not None:  # sampler-trainer mismatch histograms (functions/trainer/mismatch.py)
                    from openrl.observe import metrics

                    info = self.runs.get(p.model_id)
                    metrics.record_sample_train(info.base_model if info else None, r.metrics)
                out.append(proto.encode_forward_backward_output(r.loss_fn_outputs, r.metrics))
        return out

    async def _run_optims(self, items: list[Pending]) -> list:
        """The ready optim_steps of several runs of one base model, as one fused AdamW update."""
        engine = self._engine(items[0].model_id)
        steps = [(p.model_id, dict(p.payload.adam_params)) for p in items]
        async with self._lock:
            results = await asyncio.to_thread(engine.optim_step_many, steps)
        return [r if isinstance(r, BaseException) else {"metrics": r or {}} for r in results]

    async def _run_single(self, p: Pending):
        if p.op == "skip":
            return None
        engine = self._engine(p.model_id)
        d = p.payload
        if p.op == "optim_step":
            async with self._lock:
                metrics = await asyncio.to_thread(engine.optim_step, p.model_id, dict(d.adam_params))
            return {"metrics": metrics or {}}
        if p.op in ("save_weights", "save_weights_for_sampler", "save_weights_external"):
            # external_weights: the PEFT adapter only, like a sampler snapshot (downloadable)
            return await self._save(engine, p.model_id, d, sampler=(p.op != "save_weights"))
        if p.op == "load_weights":
            ckpt = TinkerPath.parse(d.path)
            src = await asyncio.to_thread(self.storage.get_dir, ckpt)
            async with self._lock:
                await asyncio.to_thread(engine.load_state, p.model_id, src, d.optimizer)
            return {"path": str(ckpt), "model_id": p.model_id}
        raise UserError("type", f"unsupported training operation {p.op!r}")

    async def _save(self, engine, model_id: str, d: payloads.SaveWeights, *, sampler: bool) -> dict:
        """Write a checkpoint of the run (sampler snapshot when ``sampler``); the future's result
        ``{path[, size_bytes][, sampling_session_id]}``."""
        path = TinkerPath.parse(d.path)
        meta = self.runs.meta(model_id)
        extra = {"base_model": meta.get("base_model"), "lora_config": meta.get("lora_config"),
                 "optimizer_config": meta.get("optimizer_config"),
                 **({"user_metadata": d.user_metadata} if d.user_metadata else {})}
        if (sampler and d.sampling_session_id and path.kind == "sampler_weights" and self.snapshots is not None
                and await self.snapshots.save(engine, model_id, path, seq_id=d.seq_id, owner=d.owner,
                                              ttl_seconds=d.ttl_seconds, extra=extra)):
            return {"path": str(path), "sampling_session_id": d.sampling_session_id}
        tmp = Path(tempfile.mkdtemp(prefix="openrl-save-", dir=self.storage.scratch_dir()))
        try:
            async with self._lock:
                if sampler:  # only the device-to-host copy holds the engine; the write runs beside passes
                    snapshot = await asyncio.to_thread(engine.sampler_snapshot, model_id)
                else:
                    await asyncio.to_thread(engine.save_state, model_id, tmp, True)
            if sampler:
                await asyncio.to_thread(engine.write_sampler_snapshot, snapshot, tmp)
                del snapshot
            manifest = build_manifest(tmp, path, owner=d.owner, ttl_seconds=d.ttl_seconds,
                                      extra={**extra, "seq_id": d.seq_id})
            try:
                await asyncio.to_thread(self.storage.put_dir, path, tmp, manifest)
            except CheckpointExists:
                # a redelivered save (e.g. cut by a restart before its cursor moved) finds its own checkpoint
                old = await asyncio.to_thread(self.storage.manifest, path)
                if not (old and old.get("training_run_id") == model_id and old.get("seq_id") == d.seq_id
                        and d.seq_id is not None):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        out = {"path": str(path)}
        if path.kind == "external_weights":
            out["size_bytes"] = int(manifest.get("size_bytes") or 0)
        if d.sampling_session_id:
            out["sampling_session_id"] = d.sampling_session_id
        return out


_APPLIED = object()  # marker: a redelivered request below the run's cursor (already applied and answered)
