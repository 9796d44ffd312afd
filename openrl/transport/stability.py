"""The stability store: :class:`openrl.contract.stability.SequenceRecord` s in a JetStream KV bucket.

The sampler writes a record per sampled sequence when a request sets ``record_stability_info``;
the trainer reads them for ``stable_reinforce`` and rewrites each one it trains on (a new
revision with a fresh ``used_at``: the day restarts, :data:`openrl.contract.stability.TTL_S`).
The bucket's own TTL (``max_age``, set when the bucket is created) is the same day, so the
server drops records nobody used; :meth:`StabilityStore.expired` applies the rule exactly (and
takes an injected clock, so tests need not wait a day).

The functions open a store lazily on first use, from ``Settings.nats_url`` (the same NATS the
JetStream workers and, on Knative, ``OPENRL_NATS_URL`` name): nothing connects unless someone
samples with ``record_stability_info`` or trains with ``stable_reinforce``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterable

import nats
from nats.js import api
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from openrl.contract.stability import BUCKET, TTL_S, SequenceRecord
from openrl.transport.bus import kv_key


class StabilityStore:
    """Records by ``sequence_id`` in KV bucket :data:`~openrl.contract.stability.BUCKET`.

    Args:
        url: NATS server URL. ttl_s: seconds a record stays trainable after its ``used_at``
            (also the bucket's ``max_age`` when this store creates it). clock: unix seconds
            (``time.time``; tests pass their own).
    """

    def __init__(self, url: str, *, ttl_s: float = TTL_S, clock: Callable[[], float] = time.time):
        self.url, self.ttl_s, self.clock = url, float(ttl_s), clock
        self._nc = None
        self._kv = None
        self._lock = asyncio.Lock()

    async def _bucket(self):
        async with self._lock:
            if self._kv is None:
                self._nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
                js = self._nc.jetstream(timeout=10)
                try:
                    self._kv = await js.key_value(BUCKET)
                except BucketNotFoundError:
                    self._kv = await js.create_key_value(api.KeyValueConfig(
                        bucket=BUCKET, history=1, storage=api.StorageType.FILE, max_value_size=-1, ttl=self.ttl_s))
            return self._kv

    async def put_many(self, records: dict[str, SequenceRecord]) -> None:
        """Store ``sequence_id -> record`` (``used_at`` as given), concurrently.

        Raises:
            nats.errors.Error: the server did not take a write (the caller fails its request).
        """
        kv = await self._bucket()
        await asyncio.gather(*(kv.put(kv_key(sid), rec.to_bytes()) for sid, rec in records.items()))

    async def get(self, sequence_id: str) -> SequenceRecord | None:
        """The record of ``sequence_id``, or None when none is stored (never recorded, dropped by
        the bucket's TTL, or unreadable). Expiry by ``used_at`` is :meth:`expired`'s."""
        kv = await self._bucket()
        try:
            entry = await kv.get(kv_key(sequence_id))
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            return SequenceRecord.from_bytes(entry.value)
        except (ValueError, KeyError):
            return None

    def expired(self, rec: SequenceRecord) -> bool:
        """Whether more than ``ttl_s`` seconds passed since the record's ``used_at``."""
        return self.clock() - rec.used_at > self.ttl_s

    async def touch(self, items: Iterable[tuple[str, SequenceRecord]]) -> None:
        """Restart the day of each record: rewrite it with ``used_at`` = now (a new KV revision,
        so the bucket's ``max_age`` restarts too)."""
        now = self.clock()
        fresh = {}
        for sid, rec in items:
            rec.used_at = now
            fresh[sid] = rec
        if fresh:
            await self.put_many(fresh)

    async def delete(self, sequence_id: str) -> None:
        """Drop one record (an expired one, so that it is never served again)."""
        kv = await self._bucket()
        try:
            await kv.delete(kv_key(sequence_id))
        except KeyNotFoundError:
            pass

    async def close(self) -> None:
        """Close the NATS connection, if one was opened."""
        if self._nc is not None:
            await self._nc.close()
            self._nc, self._kv = None, None
