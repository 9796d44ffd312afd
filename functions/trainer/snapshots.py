"""Unnamed sampler snapshots through host memory: the trainer's half of
:mod:`openrl.storage.handoff` (issue 31 item 1).

``save_weights_and_get_sampling_client()`` sends an unnamed ``save_weights_for_sampler``
(``sampling_session_id`` set); the SDK only keeps the sampling session, and calls such
snapshots "always ephemeral". On one machine (``OPENRL_COLOCATED_SAMPLER``) the trainer:

1. under the engine lock, packs the run's adapter into one private GPU buffer
   (:meth:`TrainerEngine.pack_sampler_snapshot`: a queued ``torch.cat``, milliseconds of the
   lock), then, with the lock released (other runs' passes go on), copies it through a pinned
   host buffer into a file on the handoff's tmpfs (:meth:`TrainerEngine.write_packed_snapshot`;
   at most ``writers`` at a time, ``Settings.handoff_writers``, which bounds the GPU and pinned
   buffers);
   ``handoff_staged=False`` does the whole write under the lock, straight into the file's pages;
2. answers the future (``{path, sampling_session_id}``): the sampler reads the snapshot from
   the handoff, before storage;
3. in the background (at most :data:`PERSIST_CONCURRENCY` at a time), copies the files to
   storage's scratch directory, builds the manifest (sizes, sha256) and ``put_dir``s the
   checkpoint at the same ``tinker://`` path, then marks the entry durable.

A background write that fails is retried (:data:`PERSIST_TRIES`), counted in
``openrl_snapshot_persist_failures_total`` and logged as an error; the entry then stays in the
handoff (it is never evicted before it is durable) and the next trainer start retries it
(:meth:`SnapshotWriter.recover`), as does ``stop()`` first (:meth:`SnapshotWriter.drain`).
Until its write completes the snapshot is sampled through its session, but not yet listed,
downloadable, or usable as ``create_sampling_client(model_path=...)``: the gateway waits
for it there (:func:`functions.gateway.runs.readable_manifest`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from pathlib import Path

from functions.trainer.pass_window import PassWindow
from openrl.model.lora import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from openrl.observe import metrics
from openrl.storage import CheckpointExists, Storage, TinkerPath, build_manifest
from openrl.storage.handoff import SnapshotHandoff

log = logging.getLogger("openrl.trainer.snapshots")

PERSIST_CONCURRENCY = 2
PERSIST_TRIES = 3


class SnapshotWriter:
    """Writes unnamed sampler snapshots to a :class:`SnapshotHandoff` and persists them.

    Args:
        handoff: the shared-memory directory. storage: the durable store.
        engine_lock: the lock that serialises engine computations (held while the adapter is
            packed; with ``staged=False`` for the whole write), or the trainer's
            :class:`~functions.trainer.pass_window.PassWindow` over it: a staged pack then runs
            beside a pass that holds the lock.
        staged: ``Settings.handoff_staged``. writers: ``Settings.handoff_writers`` (most
            snapshots written at once). spares: ``Settings.handoff_spares`` (pre-allocated
            files kept per adapter size; a staged save writes over one: :meth:`SnapshotHandoff.
            take_spare`, refilled in the background after each save).
    """

    def __init__(self, handoff: SnapshotHandoff, storage: Storage, engine_lock: asyncio.Lock | PassWindow, *,
                 staged: bool = True, writers: int = 2, spares: int = 0):
        self.handoff = handoff
        self.storage = storage
        self._window = engine_lock if isinstance(engine_lock, PassWindow) else PassWindow(engine_lock, enabled=False)
        self._lock = self._window.lock
        self.staged = staged
        self.writers = max(1, int(writers))
        self.spares = max(0, int(spares)) if staged else 0
        self._spare_task: asyncio.Task | None = None
        self._writers = asyncio.Semaphore(self.writers)
        self._sem = asyncio.Semaphore(PERSIST_CONCURRENCY)
        self._tasks: set[asyncio.Task] = set()

    async def save(self, engine, model_id: str, path: TinkerPath, *, seq_id: int | None, owner: str,
                   ttl_seconds: int | None, extra: dict) -> bool:
        """Hand the run's adapter to the sampler through memory and persist it in the background.

        Args:
            engine: the run's ``TrainerEngine``. path: the snapshot's ``tinker://`` path.
            extra: the manifest's run fields (base_model, lora_config, ...).

        Returns:
            True when the snapshot is in the handoff (now, or from an earlier delivery of the
            same request); False when it does not fit: the caller writes it to storage itself.

        Raises:
            NotFound: unknown run. CheckpointExists: ``path`` is held for another request.
        """
        held = self.handoff.get(path)
        if held is not None:  # a redelivered save: its own entry, or someone else's path
            meta = self.handoff.meta(path)
            if meta.get("training_run_id") != model_id or meta.get("seq_id") != seq_id or seq_id is None:
                raise CheckpointExists("path", f"{path} already exists; saved weights are immutable")
            self._persist_later(path)
            return True
        if await asyncio.to_thread(self.storage.manifest, path) is not None:
            return False  # already durable (a redelivery after its write): the storage path answers
        meta = {"tinker_path": str(path), "training_run_id": model_id, "seq_id": seq_id, "owner": owner,
                "ttl_seconds": ttl_seconds, "extra": extra}
        nbytes = engine.adapter_nbytes(model_id)
        async with self._writers:  # bounds the packed buffers alive at once
            if self.staged:  # the packing sees no optimizer step half done: the lock, or a pass's window
                async with self._window.pack(engine) as beside:
                    packed = await asyncio.to_thread(engine.pack_sampler_snapshot, model_id)
                metrics.SNAPSHOT_PACKS.labels("beside_pass" if beside else "locked").inc()
                entry = await self._put(engine, path, nbytes, packed, meta)
            else:
                async with self._lock:
                    packed = await asyncio.to_thread(engine.pack_sampler_snapshot, model_id)
                    entry = await self._put(engine, path, nbytes, packed, meta)
            del packed
        metrics.SNAPSHOT_SAVES.labels("memory" if entry is not None else "storage").inc()
        if entry is None:
            return False
        self._persist_later(path)
        return True

    async def _put(self, engine, path: TinkerPath, nbytes: int, packed, meta: dict):
        staged, handoff = self.staged, self.handoff
        fsize = packed[0].nbytes  # the weights file's exact size (header included)

        def write(d: Path):
            if self.spares:
                handoff.take_spare(fsize, d / ADAPTER_WEIGHTS_NAME)
            return engine.write_packed_snapshot(packed, d, staged=staged)

        entry = await asyncio.to_thread(handoff.put, path, nbytes, write, meta)
        if self.spares and (self._spare_task is None or self._spare_task.done()):
            self._spare_task = asyncio.get_running_loop().create_task(
                asyncio.to_thread(handoff.make_spares, fsize, self.spares))  # off the answer's path
        return entry

    def _persist_later(self, path: TinkerPath) -> None:
        if self.handoff.durable(path):
            return
        task = asyncio.get_running_loop().create_task(self._persist(path))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _persist(self, path: TinkerPath) -> None:
        async with self._sem:
            for attempt in range(PERSIST_TRIES):
                try:
                    await asyncio.to_thread(self.persist_now, path)
                    return
                except Exception as exc:  # noqa: BLE001 - kept in the handoff, retried, counted
                    if attempt + 1 == PERSIST_TRIES:
                        metrics.SNAPSHOT_PERSIST_FAILURES.inc()
                        log.error("sampler snapshot %s is not in storage after %d tries (%s: %s); it stays "
                                  "in the handoff %s and the next trainer start retries it", path,
                                  PERSIST_TRIES, type(exc).__name__, exc, self.handoff.root)
                    else:
                        await asyncio.sleep(1.0 * (attempt + 1))

    def persist_now(self, path: TinkerPath) -> None:
        """Write the handoff entry of ``path`` to storage (manifest last) and mark it durable.
        A checkpoint already at ``path`` from the same request counts as written.

        Raises:
            FileNotFoundError: no such entry. CheckpointExists: ``path`` holds another
                request's checkpoint. OSError / storage errors: the write failed.
        """
        if self.handoff.durable(path):
            return
        src, meta = self.handoff.dir_of(path), self.handoff.meta(path)
        tmp = Path(tempfile.mkdtemp(prefix="openrl-persist-", dir=self.storage.scratch_dir()))
        try:
            for name in (ADAPTER_WEIGHTS_NAME, ADAPTER_CONFIG_NAME):
                shutil.copyfile(src / name, tmp / name)
            manifest = build_manifest(tmp, path, owner=meta["owner"], ttl_seconds=meta.get("ttl_seconds"),
                                      extra={**meta.get("extra", {}), "seq_id": meta.get("seq_id")})
            try:
                self.storage.put_dir(path, tmp, manifest)
            except CheckpointExists:
                old = self.storage.manifest(path) or {}
                if not (old.get("training_run_id") == meta["training_run_id"]
                        and old.get("seq_id") == meta.get("seq_id") is not None):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.handoff.mark_durable(path)

    async def drain(self) -> None:
        """Wait for the background writes under way, then write what is still pending."""
        if self._spare_task is not None:
            await asyncio.gather(self._spare_task, return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self.recover()

    async def recover(self) -> None:
        """Persist the entries that a previous trainer left in the handoff unwritten."""
        for path, _d, _meta in await asyncio.to_thread(self.handoff.pending):
            await self._persist(path)
