"""NATS JetStream: the streams requests travel on and the KV buckets results live in.

The layout (stream and bucket names, subjects) is :mod:`openrl.contract.topology`'s; all of it
is created idempotently by :meth:`Bus.connect`. The records are :mod:`openrl.contract.records`'.
Any gateway replica can answer any future: results live only in the KV bucket.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import nats
from nats.js import api
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from openrl.config import Settings
from openrl.contract.records import FutureRecord
from openrl.contract.topology import (
    FUTURES_BUCKET,
    META_BUCKET,
    SAMPLE_STREAM,
    STREAMS,
    TRAIN_STREAM,
    sample_subject,
    train_subject,
)

# re-exported for the transports and tests that import them from here
__all__ = ["Bus", "FutureWaiter", "FutureRecord", "kv_key", "kv_key_decode", "now_iso", "dumps",
           "TRAIN_STREAM", "SAMPLE_STREAM", "FUTURES_BUCKET", "META_BUCKET", "train_subject", "sample_subject"]


def kv_key(*parts: str) -> str:
    """A KV key from arbitrary strings (ids contain ``:`` which KV keys may not).

    Each part is base32-encoded (no padding), parts joined with ``.`` so prefix
    listing by the first part still works. An empty part (an empty id from a client) is
    ``_``, outside the base32 alphabet: KV keys may not hold empty tokens, and a lookup of
    ``""`` must find nothing rather than fail.
    """
    return ".".join(base64.b32encode(p.encode()).decode().rstrip("=") or "_" for p in parts)


def kv_key_decode(key: str) -> list[str]:
    """Inverse of :func:`kv_key`."""
    out = []
    for p in key.split("."):
        if p == "_":
            out.append("")
            continue
        p += "=" * (-len(p) % 8)
        out.append(base64.b32decode(p).decode())
    return out


class Bus:
    """A NATS connection with the openrl streams and buckets.

    Args:
        url: NATS server URL (``nats://127.0.0.1:4222``); default ``$OPENRL_NATS_URL``.
        ack_wait_s: JetStream ack wait of the work consumers (seconds; default
            ``$OPENRL_ACK_WAIT_S``, else 30); workers send in-progress acks while a request
            runs, so this only bounds how long a dead worker's request waits before
            redelivery. It is fixed when a consumer is first created (a later worker with
            another value binds the existing consumer unchanged).
    """

    def __init__(self, url: str | None = None, *, ack_wait_s: float | None = None, max_deliver: int = 5):
        if not url or ack_wait_s is None:
            env = Settings()
            url = url or env.nats_url
            ack_wait_s = env.ack_wait_s if ack_wait_s is None else ack_wait_s
        self.url = url
        if not ack_wait_s > 0:
            raise ValueError(f"ack_wait_s (OPENRL_ACK_WAIT_S) must be > 0 seconds, got {ack_wait_s}")
        self.ack_wait_s = float(ack_wait_s)
        self.max_deliver = max_deliver
        self.nc: nats.NATS | None = None
        self.js = None
        self.futures = None
        self.meta = None

    async def connect(self) -> "Bus":
        """Connect, then create streams and buckets if missing (idempotent).

        Raises:
            nats.errors.NoServersError: no server at ``url``.
        """
        return await self.attach(await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.5))

    async def attach(self, nc: nats.NATS) -> "Bus":
        """Use the open connection ``nc`` (e.g. the embedded stack supervisor's), then create
        streams and buckets if missing, as :meth:`connect` does; :meth:`close` closes ``nc``.

        Raises:
            nats.errors.Error: JetStream did not answer.
        """
        self.nc = nc
        self.js = self.nc.jetstream(timeout=10)
        for name, subjects in STREAMS.items():
            cfg = api.StreamConfig(
                name=name,
                subjects=subjects,
                retention=api.RetentionPolicy.WORK_QUEUE,
                storage=api.StorageType.FILE,
                duplicate_window=120.0,
                max_msg_size=64 * 1024 * 1024,
            )
            try:
                await self.js.stream_info(name)
            except NotFoundError:
                await self.js.add_stream(cfg)
        self.futures = await self._bucket(FUTURES_BUCKET)
        self.meta = await self._bucket(META_BUCKET)
        return self

    async def _bucket(self, name: str):
        """Bind a KV bucket, creating it if missing. ``OPENRL_FUTURES`` entries expire after
        ``$OPENRL_FUTURES_TTL_S`` seconds (default 7 days; 0 = never) so the bucket does not
        grow without bound under load; the TTL is set when the bucket is created."""
        try:
            return await self.js.key_value(name)
        except BucketNotFoundError:
            ttl = Settings().futures_ttl_s if name == FUTURES_BUCKET else 0
            return await self.js.create_key_value(
                api.KeyValueConfig(bucket=name, history=1, storage=api.StorageType.FILE, max_value_size=-1,
                                   ttl=ttl or None)
            )

    async def close(self) -> None:
        """Close the NATS connection (no-op when not connected or already closed)."""
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()

    # ----- publishing -------------------------------------------------------------
    async def publish(self, subject: str, headers: dict[str, str], body: bytes, msg_id: str) -> None:
        """Publish one request event; ``msg_id`` becomes ``Nats-Msg-Id`` so a retried publish is dropped."""
        await self.js.publish(subject, body, headers={**headers, "Nats-Msg-Id": msg_id})

    async def work_consumer(self, stream: str, durable: str, filter_subject: str, max_ack_pending: int = 4096):
        """A durable pull subscription shared by all replicas of one worker kind."""
        cfg = api.ConsumerConfig(
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            max_ack_pending=max_ack_pending,
            filter_subject=filter_subject,
        )
        return await self.js.pull_subscribe(filter_subject, durable=durable, stream=stream, config=cfg)

    # ----- futures ----------------------------------------------------------------
    async def future_create(self, request_id: str, op: str, meta: dict | None = None) -> bool:
        """Record a pending future. Returns False if the id already exists (a duplicate request)."""
        try:
            await self.futures.create(kv_key(request_id), FutureRecord("pending", op, meta=meta).encode())
            return True
        except KeyWrongLastSequenceError:
            return False

    async def future_get(self, request_id: str) -> FutureRecord | None:
        """The future record of ``request_id``, or None when there is none (never created, expired or deleted)."""
        try:
            entry = await self.futures.get(kv_key(request_id))
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return FutureRecord.decode(entry.value)

    async def future_put(self, request_id: str, record: FutureRecord) -> None:
        """Write the future record of ``request_id`` (a result replaces the pending marker)."""
        await self.futures.put(kv_key(request_id), record.encode())

    # ----- metadata ---------------------------------------------------------------
    async def meta_get(self, *key: str) -> dict | None:
        """The JSON record under ``kv_key(*key)`` in ``OPENRL_META`` (e.g. ``("model", model_id)``), or None."""
        try:
            entry = await self.meta.get(kv_key(*key))
        except KeyNotFoundError:
            return None
        return json.loads(entry.value) if entry.value else None

    async def meta_put(self, value: dict, *key: str) -> None:
        """Write a JSON record under ``kv_key(*key)`` (last writer wins; see :meth:`meta_update` for compare-and-set)."""
        await self.meta.put(kv_key(*key), json.dumps(value).encode())

    async def meta_create(self, value: dict, *key: str) -> bool:
        """Create-only write; False if the key exists."""
        try:
            await self.meta.create(kv_key(*key), json.dumps(value).encode())
            return True
        except KeyWrongLastSequenceError:
            return False

    async def meta_update(self, fn, *key: str, retries: int = 20) -> dict:
        """Compare-and-set update: ``fn(old_or_None) -> new``; retried on concurrent writes."""
        k = kv_key(*key)
        for _ in range(retries):
            try:
                entry = await self.meta.get(k)
                old, rev = (json.loads(entry.value) if entry.value else None), entry.revision
            except KeyNotFoundError:
                old, rev = None, None
            new = fn(old)
            try:
                if rev is None:
                    await self.meta.create(k, json.dumps(new).encode())
                else:
                    await self.meta.update(k, json.dumps(new).encode(), last=rev)
                return new
            except KeyWrongLastSequenceError:
                await asyncio.sleep(0.005)
        raise RuntimeError(f"meta_update: too much contention on {key}")

    async def kv_keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Keys of KV bucket ``bucket`` that hold a value and start with ``prefix``.

        ``prefix`` is a whole key part plus ``"."`` (``kv_key(part) + "."``) or empty; the
        server filters by it. The bucket's stream is read with an ordered, headers-only
        consumer delivering the last message per key until a message reports nothing pending.
        (nats-py's ``KeyValue.keys()`` is not used: its end-of-data marker races the
        deliveries, and under load it can answer "no keys" for a full bucket.)
        """
        stream, pre = f"KV_{bucket}", f"$KV.{bucket}."
        try:
            if not (await self.js.stream_info(stream)).state.messages:
                return []
        except NotFoundError:
            return []
        sub = await self.js.subscribe(pre + (prefix + ">" if prefix else ">"), stream=stream, ordered_consumer=True,
                                      deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT, headers_only=True)
        keys: list[str] = []
        try:
            info = await sub.consumer_info()  # server-side counts: no race with the deliveries
            if info.num_pending == 0 and info.delivered.consumer_seq == 0:
                return []
            while True:
                msg = await sub.next_msg(timeout=self.js._timeout)
                h = msg.headers or {}
                if h.get("KV-Operation") not in ("DEL", "PURGE") and not h.get("Nats-Marker-Reason"):
                    keys.append(msg.subject[len(pre):])
                if msg.metadata.num_pending == 0:
                    return keys
        finally:
            await sub.unsubscribe()

    async def meta_list(self, prefix: str) -> list[dict]:
        """All metadata records whose first key part is ``prefix``."""
        out = []
        for k in await self.kv_keys(META_BUCKET, kv_key(prefix) + "."):
            try:
                entry = await self.meta.get(k)
            except KeyNotFoundError:
                continue
            if entry.value:
                out.append(json.loads(entry.value))
        return out

    async def meta_delete(self, *key: str) -> None:
        """Delete the record under ``kv_key(*key)``; a missing one is no error."""
        try:
            await self.meta.delete(kv_key(*key))
        except KeyNotFoundError:
            pass


class FutureWaiter:
    """One KV watcher per gateway replica that wakes long-polls when a future resolves.

    ``wait(request_id, timeout_s)`` returns the record once it is no longer pending, or
    the last (pending) record, or None, after ``timeout_s`` seconds. It reads the bucket
    once, after registering (so no update is missed); later updates come with the
    watcher's entry, so a wake-up costs no second read. A re-read every ``recheck_s``
    seconds covers a watcher that missed an update (e.g. across a reconnect).
    """

    recheck_s = 5.0

    def __init__(self, bus: Bus):
        self.bus = bus
        self._waiters: dict[str, list[asyncio.Event]] = {}
        self._latest: dict[str, bytes] = {}  # request id -> newest value seen by the watcher (waited ids only)
        self._task: asyncio.Task | None = None
        self._watcher = None
        # callbacks (request_id, raw FutureRecord bytes) on every update, e.g. the
        # submit → result latency of openrl.observe.metrics.FutureTracker
        self.listeners: list = []

    async def start(self) -> None:
        """Subscribe to new updates of the futures bucket (an ordered push consumer that
        starts at the next message: unlike ``KeyValue.watchall``, a replica does not replay
        the newest value of every future ever made when it starts)."""
        from nats.js.api import DeliverPolicy

        prefix = f"$KV.{FUTURES_BUCKET}."

        async def on_msg(msg) -> None:
            op = (msg.headers or {}).get("KV-Operation")
            if op in ("DEL", "PURGE") or not msg.data:
                return
            self._on_update(msg.subject[len(prefix):], msg.data)

        self._watcher = await self.bus.js.subscribe(
            prefix + ">", stream=f"KV_{FUTURES_BUCKET}", cb=on_msg, ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW, inactive_threshold=300.0)

    def _on_update(self, key: str, value: bytes) -> None:
        try:
            rid = kv_key_decode(key)[0]
        except Exception:  # noqa: BLE001
            return
        evs = self._waiters.get(rid)
        if evs:
            self._latest[rid] = value
            for ev in evs:
                ev.set()
        for fn in self.listeners:
            try:
                fn(rid, value)
            except Exception:  # noqa: BLE001 - a listener never stops the watcher
                pass

    async def stop(self) -> None:
        """Stop watching the futures bucket (waiters still time out or re-read on their own)."""
        if self._task:
            self._task.cancel()
        if self._watcher:
            try:
                await self._watcher.unsubscribe()
            except Exception:  # noqa: BLE001
                pass

    async def wait(self, request_id: str, timeout_s: float, check=None) -> FutureRecord | None:
        """Wait until ``request_id`` is no longer pending, at most ``timeout_s`` seconds.

        Args:
            check: called with the first record read (None if there is none) before waiting;
                it may raise (e.g. NotFound for another key's future) to stop at once.

        Returns:
            the answered record; or the pending record (None if there is none) at the timeout.
        """
        deadline = time.monotonic() + timeout_s
        ev = asyncio.Event()
        self._waiters.setdefault(request_id, []).append(ev)
        try:
            rec = await self.bus.future_get(request_id)  # after registering: no update is missed
            if check is not None:
                check(rec)
            while True:
                if rec is not None and rec.state != "pending":
                    return rec
                left = deadline - time.monotonic()
                if left <= 0:
                    return rec
                ev.clear()
                try:
                    await asyncio.wait_for(ev.wait(), timeout=min(left, self.recheck_s))
                except asyncio.TimeoutError:
                    rec = await self.bus.future_get(request_id)
                    continue
                raw = self._latest.get(request_id)
                rec = FutureRecord.decode(raw) if raw is not None else await self.bus.future_get(request_id)
        finally:
            lst = self._waiters.get(request_id, [])
            if ev in lst:
                lst.remove(ev)
            if not lst:
                self._waiters.pop(request_id, None)
                self._latest.pop(request_id, None)


def now_iso() -> str:
    """UTC time as ISO-8601 with milliseconds and a Z, from one clock reading (seconds and
    milliseconds from two readings could put a time near a second's end up to 1 s early, so
    records sorted by it, e.g. training runs newest first, came out of order)."""
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def dumps(obj: Any) -> bytes:
    """``obj`` as JSON bytes."""
    return json.dumps(obj).encode()
