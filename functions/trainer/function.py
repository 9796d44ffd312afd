"""The trainer Function: a CloudEvent handler for create_model, forward(_backward),
optim_step, save_weights(_for_sampler), load_weights and unload_model.

It holds one frozen base model per base-model directory (a :class:`TrainerEngine`) and,
per training run, a LoRA adapter with its AdamW state. Requests of one run execute in
seq_id order; ready forward(_backward) requests of several runs on the same base model
share one pass (see :mod:`functions.trainer.scheduler`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

from openrl import events, proto
from openrl.errors import NotFound, UserError
from openrl.registry import ModelRegistry
from openrl.storage import TinkerPath, build_manifest, open_storage

from functions.trainer.scheduler import Pending, Scheduler

SOURCE = "/openrl/trainer"


class TrainerFunction:
    """Knative Functions "instanced" shape: ``start`` / ``handle`` / ``stop`` / ``alive`` / ``ready``."""

    def __init__(self):
        self.engines: dict[str, object] = {}  # base-model dir -> TrainerEngine
        self.run_base: dict[str, str] = {}  # model_id -> base-model dir
        self.run_meta: dict[str, dict] = {}  # model_id -> {base_model, lora_config, optimizer_config}
        self._ready = False
        self._lock = asyncio.Lock()  # one engine computation at a time (one device)

    async def start(self, cfg: dict) -> None:
        """Read config, open storage, start the scheduler.

        cfg keys (env fallbacks): ``storage`` (OPENRL_STORAGE), ``models_dir`` (OPENRL_HOME/models),
        ``registry`` (OPENRL_MODEL_REGISTRY), ``device`` (OPENRL_DEVICE, default cpu),
        ``gap_timeout_s`` (OPENRL_SEQ_GAP_TIMEOUT_S), ``preload`` (base-model names to load now).
        """
        from openrl.runtime import configure_torch_threads

        configure_torch_threads()
        home = Path(os.environ.get("OPENRL_HOME", str(Path.home() / ".openrl")))
        self.storage = open_storage(cfg.get("storage") or os.environ.get("OPENRL_STORAGE", (home / "storage").as_uri()))
        reg = cfg.get("registry") or os.environ.get("OPENRL_MODEL_REGISTRY")
        self.registry = cfg.get("registry_obj") or ModelRegistry.load(
            Path(reg) if reg else None, models_dir=Path(cfg.get("models_dir") or home / "models"))
        self.device = cfg.get("device") or os.environ.get("OPENRL_DEVICE", "cpu")
        self.scheduler = Scheduler(
            self._run_packed, self._run_single, lambda mid: self.run_base.get(mid, ""),
            gap_timeout_s=float(cfg.get("gap_timeout_s") or os.environ.get("OPENRL_SEQ_GAP_TIMEOUT_S", "300")),
        )
        self.scheduler.start()
        for name in cfg.get("preload", []):
            await asyncio.to_thread(self._engine_for, name)
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        await self.scheduler.stop()

    def alive(self) -> bool:
        return True

    def ready(self) -> bool:
        return self._ready

    # ----- engines ----------------------------------------------------------------
    def _engine_for(self, base_model: str):
        from functions.trainer.engine import TrainerEngine

        entry = self.registry.resolve(base_model)
        key = str(entry.path)
        if key not in self.engines:
            self.engines[key] = TrainerEngine(Path(entry.path), device=self.device)
        return key

    def _engine(self, model_id: str):
        key = self.run_base.get(model_id)
        if key is None:
            raise NotFound("model_id", f"training run {model_id!r} is not loaded on this trainer")
        return self.engines[key]

    # ----- the handler ------------------------------------------------------------
    async def handle(self, event):
        """Run one request event; return its result event.

        Raises:
            UserError / NotFound: bad input (becomes a failed future, category "user").
        """
        op = events.op_of(event)
        model_id = event.get_subject()
        if op == "forward_backward" or op == "forward":
            fb = proto.decode_forward_backward_request(events.data_bytes(event))
            result = await self.scheduler.submit(model_id, fb.seq_id, op, fb)
            return events.result_event(event, result, source=SOURCE)
        data = events.data_json(event)
        if op == "create_model" or (op == "load_weights" and data.get("create")):
            result = await self._create(model_id, data)
        elif op == "unload_model":
            result = await self._unload(model_id)
        else:
            seq_id = int(data["seq_id"])
            result = await self.scheduler.submit(model_id, seq_id, op, data)
        if op == "skip":
            return None  # the gateway already answered that call with a 4xx
        return events.result_event(event, result, source=SOURCE)

    async def _create(self, model_id: str, data: dict) -> dict:
        from openrl.lora import LoraSpec

        lora = data.get("lora_config") or {}
        if model_id in self.run_base:  # a redelivered create: already applied
            return {"model_id": model_id, "type": "create_model"}
        key = await asyncio.to_thread(self._engine_for, data["base_model"])
        engine = self.engines[key]
        spec = LoraSpec(rank=int(lora.get("rank", 32)), seed=lora.get("seed"),
                        train_attn=lora.get("train_attn", True), train_mlp=lora.get("train_mlp", True),
                        train_unembed=lora.get("train_unembed", True))
        async with self._lock:
            if data.get("create") and data.get("path"):
                ckpt = TinkerPath.parse(data["path"])
                src = await asyncio.to_thread(self.storage.get_dir, ckpt)
                await asyncio.to_thread(engine.create_run, model_id, spec)
                await asyncio.to_thread(engine.load_state, model_id, src, bool(data.get("optimizer")), spec)
            else:
                await asyncio.to_thread(engine.create_run, model_id, spec)
        self.run_base[model_id] = key
        self.run_meta[model_id] = {"base_model": data["base_model"], "lora_config": lora,
                                   "optimizer_config": data.get("optimizer_config")}
        self.scheduler.reset(model_id, 1)
        if data.get("create"):
            return {"model_id": model_id, "path": data.get("path")}
        return {"model_id": model_id, "type": "create_model"}

    async def _unload(self, model_id: str) -> dict:
        key = self.run_base.pop(model_id, None)
        if key is not None:
            async with self._lock:
                await asyncio.to_thread(self.engines[key].delete_run, model_id)
        self.scheduler.runs.pop(model_id, None)
        return {"model_id": model_id, "type": "unload_model"}

    # ----- execution (called by the scheduler, in seq_id order) ---------------------
    async def _run_packed(self, items: list[Pending]) -> list:
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
            results = await asyncio.to_thread(engine.forward_backward, work)
        out = []
        for r in results:
            if r.error is not None:
                out.append(r.error)
            else:
                out.append(proto.encode_forward_backward_output(r.loss_fn_outputs, r.metrics))
        return out

    async def _run_single(self, p: Pending):
        if p.op == "skip":
            return None
        engine = self._engine(p.model_id)
        d = p.payload
        if p.op == "optim_step":
            async with self._lock:
                metrics = await asyncio.to_thread(engine.optim_step, p.model_id, d.get("adam_params") or {})
            return {"metrics": metrics or {}}
        if p.op in ("save_weights", "save_weights_for_sampler"):
            return await self._save(engine, p.model_id, d, sampler=(p.op == "save_weights_for_sampler"))
        if p.op == "load_weights":
            ckpt = TinkerPath.parse(d["path"])
            src = await asyncio.to_thread(self.storage.get_dir, ckpt)
            async with self._lock:
                await asyncio.to_thread(engine.load_state, p.model_id, src, bool(d.get("optimizer")))
            return {"path": str(ckpt), "model_id": p.model_id}
        raise UserError("type", f"unsupported training operation {p.op!r}")

    async def _save(self, engine, model_id: str, d: dict, *, sampler: bool) -> dict:
        path = TinkerPath.parse(d["path"])
        tmp = Path(tempfile.mkdtemp(prefix="openrl-save-"))
        try:
            async with self._lock:
                if sampler:
                    await asyncio.to_thread(engine.export_sampler_weights, model_id, tmp)
                else:
                    await asyncio.to_thread(engine.save_state, model_id, tmp, True)
            meta = self.run_meta.get(model_id, {})
            manifest = build_manifest(tmp, path, owner=d.get("owner", ""), ttl_seconds=d.get("ttl_seconds"),
                                      extra={"base_model": meta.get("base_model"),
                                             "lora_config": meta.get("lora_config"),
                                             "optimizer_config": meta.get("optimizer_config"),
                                             "seq_id": d.get("seq_id")})
            await asyncio.to_thread(self.storage.put_dir, path, tmp, manifest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        out = {"path": str(path)}
        if d.get("sampling_session_id"):
            out["sampling_session_id"] = d["sampling_session_id"]
        return out
