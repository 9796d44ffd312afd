"""Workers that cannot start: the cause of a failed start, and failing a function's queued requests.

The embedded stack's supervisor (:mod:`openrl.transport.supervisor`) uses these when a trainer
or sampler keeps dying before it takes requests:

- :func:`start_error` / :func:`read_start_error`: the cause, from what the process wrote to its
  log since it started (the ``[<module>] start failed: ...`` line of :mod:`openrl.transport.worker`,
  else a traceback's last line);
- :func:`same_cause`: whether two failed starts had the same cause;
- :func:`drain`: fail the future of every request queued on the function's work consumer
  (category ``"server"``, through the dead-letter path
  :func:`openrl.transport.bindings.deadletter.fail_undelivered`) and ack it;
- :func:`publish_skips`: once the trainer is up again, the seq_ids of the training requests
  drained meanwhile are skipped, so the runs' later requests do not wait for them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path
from typing import Callable

log = logging.getLogger("openrl.supervisor")

#: Most bytes of a worker's log read for the cause of a failed start (its end).
LOG_TAIL_BYTES = 64 * 1024
#: Seconds one fetch of :func:`drain` waits; its pull requests expire on the server after that.
DRAIN_FETCH_S = 0.2
#: Messages fetched at once by :func:`drain`.
DRAIN_BATCH = 64

#: ``(model_id, seq_id, trainer shard)`` of a training request's seq_id to skip later.
Gap = tuple[str, int, str]

_MARK = re.compile(r"^\[[\w.]+\] start failed: (.+)$")
_EXC = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure|Fault)(?::.*)?$")
_FATAL = re.compile(r"^Fatal Python error: .+$")


def start_error(text: str) -> str | None:
    """The cause of a failed start in a worker's output ``text`` (its log since it started):
    the last ``[<module>] start failed: <cause>`` line (:mod:`openrl.transport.worker`), else the
    last traceback line ``SomeError: message`` or ``Fatal Python error: ...``, else the first
    line of the message of the last JSON log record at level ERROR or above; None when there is none."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = _MARK.match(ln)
        if m:
            return m.group(1)
    for ln in reversed(lines):
        if _EXC.match(ln) or _FATAL.match(ln):
            return ln
    for ln in reversed(lines):
        if ln.startswith("{"):
            try:
                rec = json.loads(ln)
            except ValueError:
                continue
            if str(rec.get("level", "")).upper() in ("ERROR", "CRITICAL") and str(rec.get("msg") or "").strip():
                return str(rec["msg"]).strip().splitlines()[0]
    return None


def read_start_error(path: Path, offset: int) -> str | None:
    """:func:`start_error` of file ``path`` from byte ``offset`` on (where the process's output
    began; at most its last :data:`LOG_TAIL_BYTES`); None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(offset, size - LOG_TAIL_BYTES) if offset <= size else max(0, size - LOG_TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return start_error(text)


def same_cause(a: str | None, b: str | None) -> bool:
    """Whether two causes are equal but for their numbers (pids, ports, addresses, sizes)."""
    return a is not None and b is not None and re.sub(r"\d+", "N", a) == re.sub(r"\d+", "N", b)


async def drain(bus, stream: str, durable: str, reason: str, skips: set[Gap],
                stopping: Callable[[], bool] = lambda: False) -> int:
    """Fail every request queued on consumer ``durable`` of ``stream`` with ``reason``.

    Binds the consumer (creating it as a worker would when none did yet), fetches what is
    pending, fails each request's future with category ``"server"`` unless it already has a
    result, and acks the message. The seq_ids of training requests, and skip requests
    themselves, are added to ``skips`` for :func:`publish_skips` (a skip consumed here has no
    effect). Only call it while no worker of that consumer runs.

    Args:
        bus: a connected :class:`openrl.transport.bus.Bus`.
        reason: the failed futures' error message.
        stopping: stops between two fetches when it returns True.

    Returns:
        How many futures were failed.

    Raises:
        nats.errors.Error: JetStream did not answer (the caller tries again later).
    """
    from nats.errors import TimeoutError as NatsTimeout

    from openrl.contract import events, payloads, topology
    from openrl.contract.ops import Op
    from openrl.transport.bindings.deadletter import dead_seq, fail_undelivered

    name, _, shard = durable.partition("-")
    spec = topology.consumer(name, int(shard) if shard.isdigit() else 0)
    sub = await bus.work_consumer(stream, durable, spec.filter_subject)
    failed = 0
    try:
        while not stopping():
            try:
                msgs = await sub.fetch(batch=DRAIN_BATCH, timeout=DRAIN_FETCH_S)
            except (NatsTimeout, asyncio.TimeoutError):
                break
            for msg in msgs:
                try:
                    event = events.from_headers_body(dict(msg.headers or {}), msg.data)
                    op = events.op_of(event)
                except Exception as exc:  # noqa: BLE001 - not a request: nothing to fail
                    log.error("dropping a message on %s/%s that is not a request: %s", stream, durable, exc)
                    await msg.term()
                    continue
                if op == Op.SKIP:
                    p = payloads.parse_payload(op, events.data_json(event))
                    skips.add((p.model_id, p.seq_id, str(event.get_extension("trainershard") or "0")))
                else:
                    if await fail_undelivered(bus, event, reason, source=spec.source):
                        failed += 1
                    gap = dead_seq(event)
                    if gap is not None:
                        skips.add(gap)
                await msg.ack()
            if len(msgs) < DRAIN_BATCH:
                break
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001 - connection closing
            pass
    return failed


async def publish_skips(bus, skips: set[Gap]) -> int:
    """Publish a skip for each of ``skips`` (fresh message ids: an earlier skip of the same
    seq_id was consumed by :func:`drain`); returns how many were published. One that cannot be
    published is logged: the trainer's gap timeout then moves that run on."""
    from openrl.transport.bindings.deadletter import publish_skip

    done = 0
    for model_id, seq_id, shard in sorted(skips):
        try:
            await publish_skip(bus, model_id, seq_id, shard, again=True)
            done += 1
        except Exception as exc:  # noqa: BLE001
            log.warning("could not publish a skip for %s:%d: %s", model_id, seq_id, exc)
    return done
