"""The TTL sweeper: deletes expired checkpoints on any backend."""

from __future__ import annotations

import time

from openrl.config import Settings
from openrl.errors import NotFound, UserError
from openrl.storage.base import Storage
from openrl.storage.layout import TinkerPath


def sweep_expired(storage: Storage, now: float | None = None) -> list[str]:
    """Delete every checkpoint whose manifest ``expires_unix`` is at or before ``now``.

    Works on any backend (it uses ``list_runs`` / ``list_run`` / ``delete``). A checkpoint
    deleted concurrently by someone else is skipped. Returns the deleted tinker:// paths.
    """
    now = time.time() if now is None else now
    deleted = []
    for run_id in storage.list_runs():
        try:
            manifests = storage.list_run(run_id)
        except UserError:  # a directory / prefix that is not a valid run id
            continue
        for m in manifests:
            expires = m.get("expires_unix")
            if expires is None or expires > now:
                continue
            path = TinkerPath.parse(m["tinker_path"])
            try:
                storage.delete(path)
            except NotFound:
                continue
            deleted.append(str(path))
    return deleted


class ExpirySweeper:
    """Runs :func:`sweep_expired` every ``interval_s`` seconds in an asyncio task.

    The gateway runs one (it is the component that never scales to zero); with several
    gateway replicas each sweeps, which is harmless (a checkpoint deleted by another
    replica is skipped). Listings already hide a checkpoint whose ``expires_unix`` has
    passed; the sweep deletes its objects.

    Args:
        storage: the checkpoint store.
        interval_s: seconds between sweeps (``$OPENRL_SWEEP_INTERVAL_S``, default 300);
            0 disables the sweeper.

    Raises:
        ValueError: ``interval_s`` (or the env var) is not a number >= 0.
    """

    def __init__(self, storage: Storage, interval_s: float | None = None):
        raw = interval_s if interval_s is not None else Settings().sweep_interval_s
        try:
            self.interval_s = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"OPENRL_SWEEP_INTERVAL_S must be a number of seconds, got {raw!r}") from None
        if self.interval_s < 0:
            raise ValueError(f"OPENRL_SWEEP_INTERVAL_S must be >= 0, got {self.interval_s}")
        self.storage = storage
        self.deleted: list[str] = []  # tinker:// paths deleted by this sweeper (most recent last, capped)
        self._task = None

    def start(self) -> None:
        import asyncio

        if self.interval_s > 0:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        import asyncio
        import logging

        log = logging.getLogger("openrl.sweeper")
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                gone = await asyncio.to_thread(sweep_expired, self.storage)
            except Exception:  # noqa: BLE001 - the next round retries
                log.exception("checkpoint TTL sweep failed")
                continue
            if gone:
                log.info("deleted %d expired checkpoint(s): %s", len(gone), ", ".join(gone))
                self.deleted = (self.deleted + gone)[-1000:]

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


