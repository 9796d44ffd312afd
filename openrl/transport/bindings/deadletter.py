"""Dead letters: a request no worker could finish fails its future instead of hanging.

A request event is redelivered when its worker dies (killed, out of memory, lost its NATS
connection) before acking it. After ``max_deliver`` deliveries JetStream stops trying and
publishes a core-NATS advisory on
``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>`` (JSON with
``stream_seq`` and ``deliveries``; see the NATS JetStream advisories docs). On Knative the
Trigger's ``deadLetterSink`` (gateway ``POST /events/dead-letter``) plays this part; in the
JetStream binding :class:`DeadLetterWatcher` does, so the SDK's poll gets a failed future
(category ``"server"``) rather than ``pending`` for ever. A dead training request's seq_id
is then skipped, so the run's later requests go on.
"""

from __future__ import annotations

import json
import logging
import uuid

from openrl.contract import events, payloads
from openrl.contract.ops import SEQUENCED_OPS
from openrl.contract.topology import train_subject
from openrl.transport.bindings.results import store_result
from openrl.transport.bus import Bus

log = logging.getLogger("openrl.deadletter")

ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}"


async def fail_undelivered(bus: Bus, event, reason: str, *, source: str) -> bool:
    """Fail the future of request ``event`` with category ``"server"``, unless it already has a result.

    Args:
        bus: a connected bus.
        event: the request CloudEvent (its ``id`` is the future's request id).
        reason: the error message the SDK shows.
        source: CloudEvent ``source`` of the error result.

    Returns:
        True if the future was failed; False if it already held a result (a worker finished
        it before the dead letter arrived), which is kept.
    """
    rec = await bus.future_get(event.get_id())
    if rec is not None and rec.state != "pending":
        return False
    await store_result(bus, events.error_event(event, reason, "server", source=source))
    return True


def dead_seq(event) -> tuple[str, int, str] | None:
    """``(model_id, seq_id, trainer shard)`` of a dead training request that holds a seq_id.

    The trainer runs a run's requests in seq_id order, so a seq_id that never gets a result
    would hold the run's later requests back until ``OPENRL_SEQ_GAP_TIMEOUT_S``; the caller
    publishes a ``skip`` for it instead (as the gateway does for a request it rejects).
    None for a sample, a run's creation or unload, or a skip.
    """
    try:
        op = events.op_of(event)
    except ValueError:
        return None
    if op not in SEQUENCED_OPS:
        return None
    model_id, _, seq = str(event.get_id()).rpartition(":")  # request id = "<model_id>:<seq_id>"
    if not seq.isdigit() or int(seq) == 0 or model_id != event.get_subject():
        return None
    return model_id, int(seq), str(event.get_extension("trainershard") or "0")


async def publish_skip(bus: Bus, model_id: str, seq_id: int, shard: str, *, again: bool = False) -> None:
    """Publish a ``skip`` request for ``seq_id`` of ``model_id`` to trainer ``shard``.

    ``again``: a skip published before may have been consumed without effect (the embedded
    supervisor drains a failing trainer's queue, skips included, and publishes them again once
    it is up): a fresh JetStream message id, so the stream's duplicate window keeps it.
    """
    rid = f"{model_id}:{seq_id}:skip"
    data = payloads.Skip(model_id=model_id, seq_id=seq_id).to_data()
    ev = events.request_event("skip", rid, model_id, data, extensions={"trainershard": shard})
    await bus.future_create(rid, "skip")
    msg_id = f"{rid}:{uuid.uuid4().hex}" if again else rid
    await bus.publish(train_subject(shard, "skip"), *events.to_headers_body(ev), msg_id=msg_id)


def gave_up_message(event, deliveries: int | None) -> str:
    """The error text of a request that ``deliveries`` deliveries could not finish."""
    try:
        op = events.op_of(event)
    except ValueError:
        op = str(event.get_type())
    times = f"{deliveries} times" if deliveries else "repeatedly"
    return (f"request {event.get_id()} ({op}) was delivered to a worker {times} and no worker finished it "
            "(it crashed or lost its NATS connection each time); retry it, and see the worker logs")


async def give_up(bus: Bus, event, deliveries: int | None, *, source: str) -> bool:
    """Fail a dead request's future (:func:`fail_undelivered`) and, for a training request,
    skip its seq_id (:func:`publish_skip`; if that publish fails the gap timeout moves the
    run on instead). Returns whether the future was failed."""
    if not await fail_undelivered(bus, event, gave_up_message(event, deliveries), source=source):
        return False
    gap = dead_seq(event)
    if gap is not None:
        try:
            await publish_skip(bus, *gap)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not publish a skip for %s: %s", event.get_id(), exc)
    return True


class DeadLetterWatcher:
    """Fails the futures of requests that reached the consumer's ``max_deliver``.

    One core-NATS queue subscription per consumer (queue group ``<durable>-deadletter``), so
    with several replicas each advisory is handled once. The dead message is read back from
    the stream by its sequence number, its future failed, and the message deleted (a
    work-queue stream would otherwise keep it).

    Args:
        bus: a connected bus.
        stream / durable: the work consumer to watch.
        source: CloudEvent ``source`` of the error results.
    """

    def __init__(self, bus: Bus, *, stream: str, durable: str, source: str):
        self.bus, self.stream, self.durable, self.source = bus, stream, durable, source
        self._sub = None

    async def start(self) -> None:
        """Subscribe to the advisory (idempotent)."""
        if self._sub is None:
            self._sub = await self.bus.nc.subscribe(ADVISORY.format(stream=self.stream, durable=self.durable),
                                                    queue=f"{self.durable}-deadletter", cb=self._on_advisory)

    async def stop(self) -> None:
        """Stop watching the advisories."""
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection already closed
                pass
            self._sub = None

    async def _on_advisory(self, msg) -> None:
        try:
            adv = json.loads(msg.data)
            seq = int(adv["stream_seq"])
        except Exception as exc:  # noqa: BLE001
            log.warning("ignoring a max-deliveries advisory that does not parse: %s", exc)
            return
        try:
            raw = await self.bus.js.get_msg(self.stream, seq)
        except Exception as exc:  # noqa: BLE001 - acked or deleted meanwhile
            log.info("dead message %s/%d is gone (%s)", self.stream, seq, exc)
            return
        try:
            event = events.from_headers_body(dict(raw.headers or {}), raw.data or b"")
        except Exception as exc:  # noqa: BLE001 - not a CloudEvent: nothing to fail
            log.error("dead message %s/%d is not a CloudEvent: %s", self.stream, seq, exc)
        else:
            failed = await give_up(self.bus, event, adv.get("deliveries"), source=self.source)
            log.error("request %s reached max deliveries (%s) on %s/%s; future %s", event.get_id(),
                      adv.get("deliveries"), self.stream, self.durable, "failed" if failed else "already done")
        try:
            await self.bus.js.delete_msg(self.stream, seq)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not delete dead message %s/%d: %s", self.stream, seq, exc)
