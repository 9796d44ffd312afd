"""What every gateway route shares: the bus, the model registry, storage and settings.

The gateway holds no private state: sessions, training runs and sampling sessions are
records in the ``OPENRL_META`` KV bucket, futures live in ``OPENRL_FUTURES``. Any
number of gateway replicas can serve the same SDK client.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from openrl.config import Settings
from openrl.contract import events, topology
from openrl.contract.records import CheckpointManifest, FutureMeta, SamplerSession, Session, TrainingRun

from openrl.observe import metrics

from openrl.observe import tracing
from functions.gateway.quotas import SAVE_OPS, TOKEN_OPS, Quotas
from openrl.transport.bus import Bus, FutureWaiter
from openrl.errors import NotFound, UserError
from openrl.model.registry import ModelRegistry
from openrl.storage import Storage


SAMPLER_CACHE_S = 60.0  # how long a replica reuses a sampling-session record (seconds)


_FROM_SETTINGS = ("long_poll_s", "trainer_shards", "max_body_bytes", "max_pending_samples", "max_pending_train",
                  "k_sink", "public_url", "download_ttl_s", "download_secret", "proto_compress")


def _setting(name: str, **kw):
    """A dataclass field whose default is :class:`openrl.config.Settings`' ``name`` (the
    OPENRL_* environment, read when the object is made); ``kw``: more :func:`dataclasses.field` options."""
    return field(default_factory=lambda: getattr(Settings(), name), **kw)


@dataclass
class GatewaySettings:
    """Tunables of the gateway (env var in brackets).

    long_poll_s: how long ``retrieve_future`` holds a request before ``try_again``
        (seconds; must stay under the SDK's 45 s read timeout) [OPENRL_LONG_POLL_S].
    trainer_shards: number of trainer shards; a training run's requests all go to
        shard ``crc32(model_id) % trainer_shards`` [OPENRL_TRAINER_SHARDS].
    max_num_samples: most sequences per sample request.
    max_tokens_limit: most tokens one sampled sequence generates: the largest ``max_tokens``
        a request may ask, and what an omitted one gets (capped at the context minus the
        prompt) [OPENRL_SAMPLER_MAX_TOKENS_CAP].
    max_body_bytes: largest accepted request body (bytes; larger ones get 413) [OPENRL_MAX_BODY_BYTES].
    max_pending_samples / max_pending_train: backpressure. When the OPENRL_SAMPLE (resp.
        OPENRL_TRAIN) stream holds this many requests not yet answered (queued or running),
        new requests get 429 with ``Retry-After``; 0 disables the check
        [OPENRL_MAX_PENDING_SAMPLES, OPENRL_MAX_PENDING_TRAIN].
    pending_refresh_s: how often the stream depth is read from JetStream (seconds); in
        between, this replica's own publishes are added to the last reading.
    public_url: base URL clients reach the gateway at, for signed download / upload / trace
        URLs (None: the request's own) [OPENRL_PUBLIC_URL].
    download_ttl_s: lifetime of a signed URL (seconds) [OPENRL_DOWNLOAD_TTL_S].
    download_secret: HMAC key of signed URLs (None: one random key kept in the KV bucket)
        [OPENRL_DOWNLOAD_SECRET].
    proto_compress: the SDK zstd-compresses forward_backward bodies [OPENRL_PROTO_COMPRESS].
    """

    long_poll_s: float = _setting("long_poll_s")
    trainer_shards: int = _setting("trainer_shards")
    max_num_samples: int = 128
    max_tokens_limit: int = _setting("sampler_max_tokens_cap")
    max_body_bytes: int = _setting("max_body_bytes")
    max_pending_samples: int = _setting("max_pending_samples")
    max_pending_train: int = _setting("max_pending_train")
    pending_refresh_s: float = 0.2
    fwdbwd_max_chunk_len: int = 1024
    heartbeat_expiry_s: float = 600.0
    k_sink: str | None = _setting("k_sink")  # Knative SinkBinding: POST request events to the Broker
    public_url: str | None = _setting("public_url")
    download_ttl_s: int = _setting("download_ttl_s")
    download_secret: str | None = _setting("download_secret", repr=False)
    proto_compress: bool = _setting("proto_compress")

    @classmethod
    def of(cls, cfg: Settings) -> "GatewaySettings":
        """The gateway's tunables from one :class:`openrl.config.Settings`."""
        return cls(**{name: getattr(cfg, name) for name in _FROM_SETTINGS},
                   max_tokens_limit=cfg.sampler_max_tokens_cap)


@dataclass
class Gateway:
    """The shared state handle of the gateway's routes."""

    bus: Bus
    registry: ModelRegistry
    storage: Storage
    settings: GatewaySettings = field(default_factory=GatewaySettings)
    waiter: FutureWaiter | None = None
    keys: object | None = None  # openrl.edge.auth.KeyRing, set by create_app
    rejected: dict[str, int] = field(default_factory=dict)  # stream -> 429s answered (this replica)
    quotas: Quotas = field(default_factory=Quotas)  # per-key quotas (functions/gateway/quotas.py)
    _depth: dict[str, list] = field(default_factory=dict)  # stream -> [messages, monotonic time read, own publishes since]
    _samplers: dict[str, tuple] = field(default_factory=dict)  # sampler id -> (record, monotonic time read)
    _vocab: dict[str, int] = field(default_factory=dict)
    _http: object | None = None
    handoff: object | None = None  # openrl.storage.handoff.SnapshotHandoff of a co-located trainer, or None

    #: seconds :meth:`manifest` waits for a handed-off snapshot's background write
    HANDOFF_WAIT_S = 30.0

    # ----- identity ---------------------------------------------------------------
    def shard_of(self, model_id: str) -> int:
        """Trainer shard of a training run: crc32(model_id) mod trainer_shards."""
        return zlib.crc32(model_id.encode()) % max(1, self.settings.trainer_shards)

    def vocab_size(self, base_model: str) -> int:
        """Vocabulary size of a registered base model (tokens), read from its config.json."""
        if base_model not in self._vocab:
            entry = self.registry.resolve(base_model)
            cfg = json.loads((Path(entry.path) / "config.json").read_text())
            self._vocab[base_model] = int(cfg["vocab_size"])
        return self._vocab[base_model]

    # ----- records ----------------------------------------------------------------
    async def session_record(self, session_id: str) -> Session | None:
        """The session record of ``session_id`` (any owner's), or None."""
        return Session.load(await self.bus.meta_get("session", session_id))

    async def model_record(self, model_id: str) -> TrainingRun | None:
        """The training-run record of ``model_id`` (any owner's), or None."""
        return TrainingRun.load(await self.bus.meta_get("model", model_id))

    async def runs(self, owner: str | None = None) -> list[TrainingRun]:
        """The training-run records of ``owner`` (None: every owner's)."""
        recs = [TrainingRun.load(r) for r in await self.bus.meta_list("model")]
        return [r for r in recs if owner is None or r.owner == owner]

    async def sessions(self, owner: str | None = None) -> list[Session]:
        """The session records of ``owner`` (None: every owner's)."""
        recs = [Session.load(r) for r in await self.bus.meta_list("session")]
        return [r for r in recs if owner is None or r.owner == owner]

    async def manifest(self, path) -> CheckpointManifest | None:
        """The manifest of the checkpoint at ``path`` (a :class:`openrl.storage.TinkerPath`), or None."""
        import asyncio
        import time

        m = await asyncio.to_thread(self.storage.manifest, path)
        if m is None and self.handoff is not None and self.handoff.get(path) is not None:
            # an unnamed sampler snapshot handed to the sampler through memory: its durable write
            # (functions/trainer/snapshots.py) is under way; wait for it rather than answer 404
            deadline = time.monotonic() + self.HANDOFF_WAIT_S
            while m is None and time.monotonic() < deadline and not self.handoff.durable(path):
                await asyncio.sleep(0.05)
                m = await asyncio.to_thread(self.storage.manifest, path)
            m = m or await asyncio.to_thread(self.storage.manifest, path)
        return CheckpointManifest.load(m)

    async def run_manifests(self, run_id: str) -> list[CheckpointManifest]:
        """The manifests of every checkpoint of training run ``run_id`` (any owner's, expired ones too)."""
        import asyncio

        return [CheckpointManifest.load(m) for m in await asyncio.to_thread(self.storage.list_run, run_id)]

    async def session(self, session_id: str, owner: str) -> Session:
        """The session record, or NotFound (also for another key's session)."""
        rec = await self.session_record(session_id)
        if rec is None or rec.owner != owner:
            raise NotFound("session_id", f"unknown session {session_id!r}")
        return rec

    async def update_session(self, session_id: str, change: Callable[[Session], None],
                             missing: Session | None = None) -> None:
        """Compare-and-set update of a session record: ``change`` assigns fields of the record
        read (concurrent appends, heartbeats and finishes are kept); the record is written back
        with its keys as read plus the fields assigned (:meth:`Record.stored`). A record gone
        meanwhile is written from ``missing`` (a copy), or else as the assigned fields alone."""

        def apply(old: dict | None) -> dict:
            if old is not None:
                rec = Session.load(old)
            elif missing is not None:
                rec = missing.model_copy(deep=True)
            else:
                rec = Session.model_construct()
            change(rec)
            return rec.stored()

        await self.bus.meta_update(apply, "session", session_id)

    async def model(self, model_id: str, owner: str, field_name: str = "model_id") -> TrainingRun:
        """The training-run record, or NotFound (also for another key's run)."""
        rec = await self.model_record(model_id)
        if rec is None or rec.owner != owner:
            raise NotFound(field_name, f"unknown training run {model_id!r}")
        return rec

    async def sampler(self, sampler_id: str, owner: str) -> SamplerSession:
        """The sampling-session record, or NotFound (also for another key's session).

        Records are immutable once written, so each replica keeps them for
        ``SAMPLER_CACHE_S`` seconds: a busy sampler costs one metadata read a minute, not
        one per ``asample``.
        """
        import time

        hit = self._samplers.get(sampler_id)
        if hit is not None and time.monotonic() - hit[1] < SAMPLER_CACHE_S:
            rec = hit[0]
        else:
            rec = SamplerSession.load(await self.bus.meta_get("sampler", sampler_id))
            if rec is not None:
                if len(self._samplers) >= 10_000:
                    self._samplers.clear()
                self._samplers[sampler_id] = (rec, time.monotonic())
        if rec is None or rec.owner != owner:
            raise NotFound("sampling_session_id", f"unknown sampling session {sampler_id!r}")
        return rec

    def body_limit(self) -> int:
        """Largest request body that can be accepted and published (bytes): the configured
        ``max_body_bytes``, and under the NATS server's ``max_payload`` (less 64 KiB for the
        event headers) so that an accepted request can always be published."""
        limit = self.settings.max_body_bytes
        mp = getattr(getattr(self.bus, "nc", None), "max_payload", 0) or 0
        if mp > 0 and not self.settings.k_sink:
            limit = min(limit, mp - 64 * 1024)
        return limit

    # ----- backpressure -----------------------------------------------------------
    def _limit_of(self, stream: str) -> int:
        from openrl.transport.bus import SAMPLE_STREAM

        s = self.settings
        return s.max_pending_samples if stream == SAMPLE_STREAM else s.max_pending_train

    async def over_limit(self, stream: str) -> bool:
        """Whether ``stream`` (``OPENRL_SAMPLE`` / ``OPENRL_TRAIN``) holds at least its limit of
        unanswered requests.

        The depth is JetStream's message count of the work-queue stream (queued plus running:
        a message leaves the stream when its worker acks it, after the result is stored), so
        every gateway replica sees the same queue. It is read at most every
        ``pending_refresh_s`` seconds; in between, this replica's own publishes are added.
        That estimate only grows (acks are not seen between readings), so a request is
        rejected only on a reading taken after this replica's last publish: an estimate at
        the limit is read again first. Always False when the limit is 0 or requests go to a
        Knative Broker (``K_SINK``).
        """
        limit = self._limit_of(stream)
        if limit <= 0 or self.settings.k_sink:
            return False
        import time

        d = self._depth.get(stream)
        if d is None:
            d = self._depth[stream] = [0, time.monotonic(), 0]  # messages, time read, own publishes since
        stale = time.monotonic() - d[1] > self.settings.pending_refresh_s
        if stale or (d[0] >= limit and d[2] > 0):
            await self._read_depth(stream, d)
        return d[0] >= limit

    async def _read_depth(self, stream: str, d: list) -> None:
        """Replace the estimate ``d`` of :meth:`over_limit` by JetStream's message count of ``stream``.

        No reading (JetStream unreachable): the estimate stays, so requests are admitted as before.
        """
        import time

        d[1], published = time.monotonic(), d[2]  # concurrent callers use the previous reading meanwhile
        try:
            info = await self.bus.js.stream_info(stream)
        except Exception:  # noqa: BLE001 - no reading: keep the last one (admit)
            return
        d[0] = int(info.state.messages) + (d[2] - published)  # publishes while the reading was under way
        d[2] -= published

    def quota_of(self, owner: str):
        """The :class:`openrl.edge.auth.Quota` of owner id ``owner`` (unlimited without a key ring)."""
        from openrl.edge.auth import Quota

        return self.keys.quota_of(owner) if self.keys is not None else Quota()

    async def admit(self, stream: str, request_id: str, *, owner: str | None = None, op: str | None = None,
                    tokens: int = 0) -> None:
        """Backpressure and quota checks before publishing ``request_id`` on ``stream``.

        A request whose future already exists is a resend (e.g. after an earlier 429 that
        was in fact accepted, or an HTTP retry) and is always admitted, so it gets the same
        future back (and is not counted against a quota twice).

        Args:
            owner: the owner id the request is charged to (None: no quota check).
            op: the operation: a save checks ``stored_bytes``; forward / forward_backward /
                sample charge ``tokens`` to ``tokens_per_min`` (:mod:`functions.gateway.quotas`).
            tokens: the request's tokens (see :mod:`functions.gateway.quotas`).

        Raises:
            Overloaded: the stream is at its limit (HTTP 429, ``Retry-After: 1``).
            QuotaExceeded: a quota of the owner's key (HTTP 429, ``Retry-After``, field ``quota.<name>``).
            UserError: one request over the key's whole ``tokens_per_min``.
        """
        from openrl.errors import Overloaded

        quota = self.quota_of(owner) if owner else None
        charge = quota is not None and (
            (op in TOKEN_OPS and quota.tokens_per_min is not None and tokens > 0)
            or (op in SAVE_OPS and quota.stored_bytes is not None))
        if await self.over_limit(stream):
            if await self.bus.future_get(request_id) is not None:
                return
            self.rejected[stream] = self.rejected.get(stream, 0) + 1
            raise Overloaded(f"{stream} holds {self._depth[stream][0]} unanswered requests "
                             f"(limit {self._limit_of(stream)}); retry later", retry_after=1.0)
        if not charge or await self.bus.future_get(request_id) is not None:
            return
        if op in SAVE_OPS:
            await self.quotas.check_stored(self.bus, self.storage, owner, quota)
        else:
            self.quotas.charge_tokens(owner, quota, tokens)

    async def admit_run(self, owner: str, model_id: str) -> None:
        """Quota check before creating training run ``model_id`` for ``owner``.

        Raises:
            QuotaExceeded: the key holds its quota of runs (HTTP 429, ``quota.runs``).
        """
        await self.quotas.check_runs(self.bus, owner, self.quota_of(owner), model_id)

    # ----- publishing -------------------------------------------------------------
    async def submit(
        self,
        op: str,
        request_id: str,
        subject: str,
        data: dict | bytes,
        *,
        shard: int = 0,
        owner: str | None = None,
        future_meta: dict | None = None,
    ) -> bool:
        """Record a pending future and publish its request event.

        A request id that already exists is a retried duplicate: False is returned (the
        caller answers with the same future). Its event is published again only while its
        future is still pending: the first attempt may have recorded the future and then
        failed to publish (NATS restarting); the copy carries the same ``Nats-Msg-Id``, so
        JetStream drops it when the first did land (120 s duplicate window), and a later
        duplicate is harmless (the trainer skips seq_ids it applied; a sample is re-run).

        ``shard``: the trainer shard of a training request (its run's ``shard``). ``owner``: the
        owner id the workers' usage metrics charge when ``future_meta`` names none.
        """
        # "t0": when the request was accepted (unix s); the session trace export starts its slice there
        meta = FutureMeta(**{**(future_meta or {}), "t0": round(time.time(), 6)})
        created = await self.bus.future_create(request_id, op, meta=meta.stored())
        if not created:
            if self.settings.k_sink:  # the sink path forgets a future whose publish failed
                return False
            old = await self.bus.future_get(request_id)
            if old is None or old.state != "pending":
                return False
        ext = {}
        if topology.function_of_op(op) == topology.TRAINER:
            ext["trainershard"] = str(shard)
        subject_nats = topology.subject_for(op, shard)
        owner_id = meta.owner or owner
        if owner_id:
            ext["owner"] = owner_id  # the owner id (never the key): per-key usage metrics in the workers
        # observability: a "publish <op>" span whose context rides in the event's traceparent;
        # it ends when the result lands (openrl.observe.metrics.FutureTracker), timing the future
        span = tracing.start_span(f"publish {op}", kind="producer", attributes={
            "cloudevents.event_id": request_id, "cloudevents.event_type": events.event_type(op),
            "cloudevents.event_subject": subject, "messaging.system": "nats",
            "messaging.destination.name": subject_nats})
        ext.update(tracing.carrier(span))
        ev = events.request_event(op, request_id, subject, data, extensions=ext)
        headers, body = events.to_headers_body(ev)
        try:
            if self.settings.k_sink:
                await self._post_to_sink(headers, body)
            else:
                await self.bus.publish(subject_nats, headers, body, msg_id=request_id)
                d = self._depth.get(topology.stream_for(op))
                if d is not None:
                    d[0] += 1
                    d[2] += 1
        except BaseException as exc:
            if span is not None:
                tracing.mark_error(span, f"publish failed: {exc}")
                span.end()
            raise
        metrics.FUTURES.track(request_id, op, span)
        return created

    async def _post_to_sink(self, headers: dict[str, str], body: bytes) -> None:
        """Deliver a request event to the Knative Broker (``K_SINK``) in binary mode.

        Raises:
            ServerError: the Broker did not accept the event (the pending future is failed too).
        """
        import httpx

        from openrl.transport.bus import kv_key
        from openrl.errors import ServerError

        if self._http is None:
            self._http = httpx.AsyncClient(timeout=30.0)
        try:
            r = await self._http.post(self.settings.k_sink, headers=headers, content=body)
            ok = r.status_code < 300
        except httpx.HTTPError:
            ok = False
        if not ok:
            # forget the pending future so that the SDK's retry publishes the request again
            await self.bus.futures.delete(kv_key(headers.get("ce-id", "")))
            raise ServerError("the event broker did not accept the request; retry")


class BodyTooLarge(UserError):
    """A request body over the gateway's limit (HTTP 413, field ``body``)."""

    status = 413


def require(cond: bool, field_name: str, message: str) -> None:
    """Raise UserError(field_name, message) unless ``cond``."""
    if not cond:
        raise UserError(field_name, message)

