"""Trainer state durability: flush every run's state to storage, restore it on a cold trainer.

A trainer pod is scaled down (SIGTERM) when idle and a fresh one starts when requests come
back (invariant 7). What a training run needs to continue exactly where it stopped:

- the LoRA adapter and its AdamW state (``engine.save_state``: PEFT files + ``optimizer.pt``),
- gradients accumulated by forward_backward calls not yet followed by optim_step (``grads.pt``),
- the seq_id cursor: the run's ``next_seq`` in the trainer's
  :class:`~functions.trainer.cursor.RunCursor` (state at cursor N = every request with
  seq_id < N applied, none >= N),
- run metadata: base model, LoRA config, optimizer config,
- results of requests that were applied but whose handler had not returned yet when the
  snapshot was taken (``results.json``): the binding may not have stored them in the futures
  KV, so a redelivery of such a request is answered with the kept result instead of
  being lost.

They are written with :meth:`openrl.storage.Storage.put_run_state` under the internal
``_runstate/<run_id>/`` area (never a tinker:// path, never in checkpoint listings), as a
new snapshot plus a compare-and-set swap of the ``HEAD.json`` pointer.

When:

- ``stop()`` (SIGTERM, after the binding drained): every run changed since its last flush,
  with ``final: true`` in the pointer;
- every ``OPENRL_FLUSH_INTERVAL_S`` seconds (default 120; 0 disables): runs whose cursor
  moved since their last flush ("dirty");
- once at creation when periodic flushes are on (cursor 1), so a run is restorable from
  its first request on;
- never per request (a hard crash loses what happened after the last flush; those
  requests' futures were already answered, so later seq_ids of that run fail after the
  scheduler's gap timeout, with category "server" when the gap is at the cursor of a
  restore from a periodic flush: ``RunCursor.lost_at`` / ``RunCursor.gap_error``).
  Requests the crashed trainer had not answered are redelivered and applied once on the
  restored state (docs/errors.md, "Faults").

Restore: the first request of a run this trainer does not hold reads the pointer and the
snapshot and installs the run at its cursor. A redelivered request with seq_id below the
cursor is not applied again (the function answers it from the kept results, or not at all:
its result is already in the futures KV). When the request's seq_id is above the cursor
and the pointer is not ``final`` (the previous trainer may still be flushing, or crashed),
the restore re-reads the pointer for up to ``OPENRL_RESTORE_WAIT_S`` seconds (default 10)
waiting for a fresher flush.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from openrl.observe import startup
from openrl.contract.records import RunStateInfo
from openrl.storage import RunState, RunStateConflict, Storage

from functions.trainer.cursor import RunCursor
from functions.trainer.runs import RunTable

log = logging.getLogger("openrl.trainer.durable")

GRADS_NAME = "grads.pt"
RESULTS_NAME = "results.json"


def lora_spec(lora: dict | None):
    """The :class:`openrl.model.lora.LoraSpec` of a create_model ``lora_config`` dict (defaults: rank 32, all
    targets, alpha 32; ``alpha`` is set for runs continued from an imported adapter)."""
    from openrl.model.lora import LoraSpec

    lora = lora or {}
    return LoraSpec(rank=int(lora.get("rank", 32)), seed=lora.get("seed"), alpha=lora.get("alpha"),
                    train_attn=lora.get("train_attn", True), train_mlp=lora.get("train_mlp", True),
                    train_unembed=lora.get("train_unembed", True))


def encode_result(value: Any) -> dict:
    """A scheduler result (protobuf bytes, a JSON dict, or None) as JSON."""
    if value is None:
        return {"none": True}
    if isinstance(value, (bytes, bytearray)):
        return {"b64": base64.b64encode(bytes(value)).decode()}
    return {"json": value}


def decode_result(rec: dict) -> Any:
    """Inverse of :func:`encode_result`."""
    if "b64" in rec:
        return base64.b64decode(rec["b64"])
    if "json" in rec:
        return rec["json"]
    return None


class RunDurability:
    """Flush / restore of the training runs of one :class:`~functions.trainer.function.TrainerFunction`.

    Args:
        storage: where run state goes (the same store as checkpoints).
        runs: the trainer's run table (which runs are held, on what base model, with what
            metadata); a restore adds to it.
        cursor: the runs' seq_id cursors, shared with the scheduler
            (:class:`~functions.trainer.cursor.RunCursor`; a restore resets a run's and seeds
            its recent results and ``lost_at``).
        engines: base-model key -> ``TrainerEngine`` (the trainer's live dict).
        load_engine: ``(base_model name) -> base-model key``, loading the engine once;
            blocking (called in a worker thread).
        engine_lock: the lock that serialises engine computations (a snapshot is taken
            while holding it, so no op is half applied).
        interval_s: periodic flush interval (seconds); 0 disables periodic flushes
            (``Settings.flush_interval_s``, $OPENRL_FLUSH_INTERVAL_S).
        restore_wait_s: how long a restore waits for a fresher pointer (seconds, see module
            doc; ``Settings.restore_wait_s``, $OPENRL_RESTORE_WAIT_S).

    Per run it keeps the pointer token it last read or wrote (the compare-and-set token) and
    the cursor of its last flush.
    """

    def __init__(self, storage: Storage, runs: RunTable, cursor: RunCursor, *,
                 engines: Mapping[str, Any], load_engine: Callable[[str], str], engine_lock: asyncio.Lock,
                 interval_s: float = 120.0, restore_wait_s: float = 10.0):
        self.storage = storage
        self.runs, self.seq = runs, cursor
        self.engines, self.load_engine, self.engine_lock = engines, load_engine, engine_lock
        self.interval_s = float(interval_s)
        self.restore_wait_s = float(restore_wait_s)
        self.tokens: dict[str, str | None] = {}  # model_id -> pointer token (None: no pointer yet)
        self.flushed: dict[str, int] = {}  # model_id -> cursor of the last flush
        self.in_flight: dict[str, set[int]] = {}  # model_id -> seq_ids whose handler has not returned
        self.flushes = 0  # snapshots written by this process (tests, metrics)
        self._run_locks: dict[str, asyncio.Lock] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._who = f"{socket.gethostname()}:{os.getpid()}"

    # ----- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self.interval_s > 0:
            self._task = asyncio.create_task(self._periodic())

    async def stop_periodic(self) -> None:
        """Stop the periodic flusher, letting a flush in progress finish (never cut mid-upload)."""
        self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def _periodic(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=self.interval_s)
            except asyncio.TimeoutError:
                pass
            if self._stop.is_set():
                return
            try:
                await self.flush_all(final=False)
            except Exception:  # noqa: BLE001 - the next round retries
                log.exception("periodic run-state flush failed")

    def run_lock(self, model_id: str) -> asyncio.Lock:
        """The per-run lock that serialises create, restore, flush and unload of one run."""
        return self._run_locks.setdefault(model_id, asyncio.Lock())

    def busy(self) -> bool:
        """Whether a create / restore / flush / unload holds a run lock now."""
        return any(lock.locked() for lock in self._run_locks.values())

    async def wait_idle(self) -> None:
        """Wait until no create / restore / flush / unload holds a run lock."""
        for lock in list(self._run_locks.values()):
            async with lock:
                pass

    # ----- bookkeeping the function does ----------------------------------------------
    def begin(self, model_id: str, seq_id: int) -> None:
        """A handler started answering ``seq_id`` of ``model_id``."""
        self.in_flight.setdefault(model_id, set()).add(seq_id)

    def end(self, model_id: str, seq_id: int) -> None:
        """That handler returned (its result goes to the binding)."""
        s = self.in_flight.get(model_id)
        if s is not None:
            s.discard(seq_id)
            if not s:
                self.in_flight.pop(model_id, None)

    def cursor(self, model_id: str) -> int:
        """The run's seq_id cursor: every request below it applied (1 when nothing ran)."""
        return self.seq.next_seq(model_id)

    def dirty(self, model_id: str) -> bool:
        """True when the run changed since its last flush (or was never flushed)."""
        return self.flushed.get(model_id) != self.cursor(model_id)

    # ----- flush ------------------------------------------------------------------------
    async def flush_all(self, *, final: bool) -> list[str]:
        """Flush every dirty run this trainer holds; returns their ids.

        With ``final`` (stop), a failure is logged per run and the others are still flushed.
        """
        done = []
        for mid in list(self.runs):
            if not self.dirty(mid):
                continue
            try:
                if await self.flush_run(mid, final=final):
                    done.append(mid)
            except RunStateConflict as exc:
                log.error("run state of %s not flushed: %s", mid, exc.message)
            except Exception:  # noqa: BLE001 - one run's failure must not stop the others
                if not final:
                    raise
                log.exception("run state of %s not flushed", mid)
        return done

    async def flush_run(self, model_id: str, *, final: bool = False) -> bool:
        """Snapshot run ``model_id`` (under the engine lock: a state consistent with its
        cursor) and store it. Returns False when the run is not held here.

        Raises:
            RunStateConflict: another trainer moved the run's pointer.
        """
        async with self.run_lock(model_id):
            if model_id not in self.runs:
                return False
            tmp = Path(tempfile.mkdtemp(prefix="openrl-runstate-"))
            try:
                async with self.engine_lock:  # no engine op of any run is half applied while we hold it
                    key = self.runs.base_key(model_id)
                    if key is None:
                        return False
                    cursor = self.seq.next_seq(model_id)
                    results = {str(s): encode_result(r)
                               for s, r in self.seq.results(model_id, self.in_flight.get(model_id, ())).items()}
                    await asyncio.to_thread(self._write_snapshot, self.engines[key], model_id, tmp, results)
                meta = self.runs.meta(model_id)
                info = RunStateInfo(model_id=model_id, cursor=cursor, final=bool(final),
                                    base_model=meta.get("base_model"), lora_config=meta.get("lora_config"),
                                    optimizer_config=meta.get("optimizer_config"),
                                    flushed_unix=time.time(), flushed_by=self._who).to_record()
                t0 = time.monotonic()
                token = await asyncio.to_thread(self.storage.put_run_state, model_id, tmp, info,
                                                self.tokens.get(model_id))
                self.tokens[model_id] = token
                self.flushed[model_id] = cursor
                self.flushes += 1
                log.info("flushed run state of %s at cursor %d (%s, %.3fs)", model_id, cursor,
                         "final" if final else "periodic", time.monotonic() - t0)
                return True
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _write_snapshot(engine, model_id: str, directory: Path, results: dict) -> None:
        import torch

        engine.save_state(model_id, directory, True)
        opt = engine.runs[model_id].optimizer
        grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in zip(opt.names, opt.params) if p.grad is not None}
        if grads:
            torch.save(grads, directory / GRADS_NAME)
        if results:
            (directory / RESULTS_NAME).write_text(json.dumps(results))

    # ----- restore ----------------------------------------------------------------------
    async def restore(self, model_id: str, seq_hint: int | None = None) -> bool:
        """Install run ``model_id`` from its stored state if this trainer does not hold it.

        Args:
            seq_hint: seq_id of the request that asked (see the module doc on waiting).

        Returns:
            True when the run is held afterwards, False when no state is stored.

        Raises:
            ChecksumMismatch: stored snapshot corrupt. UserError("checkpoint", ...): the
                snapshot does not fit the base model.
        """
        async with self.run_lock(model_id):
            if model_id in self.runs:
                return True
            return await self._restore_locked(model_id, seq_hint)

    async def _restore_locked(self, model_id: str, seq_hint: int | None) -> bool:
        rs = await asyncio.to_thread(self.storage.get_run_state, model_id, download=False)
        if rs is None:
            return False
        deadline = time.monotonic() + self.restore_wait_s
        info = RunStateInfo.model_validate(rs.info)
        while seq_hint is not None and seq_hint > info.cursor and not info.final and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            newer = await asyncio.to_thread(self.storage.get_run_state, model_id, download=False)
            if newer is None:
                return False
            rs, info = newer, RunStateInfo.model_validate(newer.info)
        rs = await asyncio.to_thread(self.storage.get_run_state, model_id)
        if rs is None:
            return False
        await self._install(model_id, rs)
        return True

    async def _install(self, model_id: str, rs: RunState) -> None:
        info = RunStateInfo.model_validate(rs.info)
        key = await asyncio.to_thread(self.load_engine, info.base_model)
        engine = self.engines[key]
        spec = lora_spec(info.lora_config)
        async with self.engine_lock:
            with startup.timed("adapter_restore"):
                await asyncio.to_thread(self._load, engine, model_id, rs.directory, spec)
        cursor = info.cursor
        self.runs.add(model_id, key, rs.info)
        results_file = rs.directory / RESULTS_NAME
        results = {int(s): decode_result(rec) for s, rec in json.loads(results_file.read_text()).items()} \
            if results_file.is_file() else {}
        # from a periodic (not final) flush: the previous trainer may have died after applying
        # requests it never flushed (RunCursor.gap_error answers "server" for that gap)
        self.seq.reset(model_id, cursor, results, lost_at=None if info.final else cursor)
        self.tokens[model_id] = rs.token
        self.flushed[model_id] = cursor
        log.info("restored run state of %s at cursor %d (flushed by %s)", model_id, cursor, info.flushed_by)

    @staticmethod
    def _load(engine, model_id: str, directory: Path, spec) -> None:
        import torch

        engine.load_state(model_id, directory, True, spec)
        gfile = directory / GRADS_NAME
        if gfile.is_file():
            grads = torch.load(gfile, map_location="cpu", weights_only=True)
            opt = engine.runs[model_id].optimizer
            for n, p in zip(opt.names, opt.params):
                if n in grads:
                    p.grad = grads[n].to(device=p.device, dtype=p.dtype)

    async def stored(self, model_id: str) -> bool:
        """True when run state of ``model_id`` is stored (reads only the pointer)."""
        return await asyncio.to_thread(self.storage.get_run_state, model_id, download=False) is not None

    # ----- unload -------------------------------------------------------------------------
    async def forget(self, model_id: str) -> None:
        """Drop the run's stored state (unload_model): a later request of it is NotFound.
        The caller holds :meth:`run_lock`."""
        self.tokens.pop(model_id, None)
        self.flushed.pop(model_id, None)
        self.in_flight.pop(model_id, None)
        await asyncio.to_thread(self.storage.delete_run_state, model_id)
