"""JetStream binding: a durable pull consumer that feeds request events to a Function.

Each message is one request CloudEvent in binary mode (``ce-*`` headers). It is handled
in its own task (up to ``concurrency`` at once: the trainer holds later seq_ids back
while earlier ones run), the result event is written to the futures KV bucket, and only
then is the message acked, so a worker that dies mid-request has it redelivered; after
``max_deliver`` deliveries its future fails (:mod:`openrl.transport.bindings.deadletter`).
While a request runs, the binding sends in-progress acks so a long training step is not
redelivered to another replica.
"""

from __future__ import annotations

import asyncio
import logging

from nats.errors import TimeoutError as NatsTimeout

from openrl import testhooks

from openrl.contract import events
from openrl.transport.bindings import handle_event
from openrl.transport.bindings.deadletter import DeadLetterWatcher, give_up
from openrl.transport.bindings.results import store_result
from openrl.transport.bus import Bus

log = logging.getLogger("openrl.jetstream")


class JetStreamWorker:
    """Runs ``function`` on messages of ``filter_subject`` from ``stream``.

    Args:
        function: an object with ``async handle(event)`` (the Function contract).
        bus: a connected :class:`openrl.transport.bus.Bus`.
        stream / durable / filter_subject: the JetStream consumer to bind.
        source: CloudEvent ``source`` of result events (e.g. ``/openrl/trainer``).
        concurrency: maximum requests in flight in this process.
        in_progress_s: interval of in-progress acks (seconds); at most a third of the bus's
            ack wait, so a live worker's request is never redelivered.
    """

    def __init__(self, function, bus: Bus, *, stream: str, durable: str, filter_subject: str, source: str,
                 concurrency: int = 256, in_progress_s: float = 5.0):
        self.function = function
        self.bus = bus
        self.stream, self.durable, self.filter_subject = stream, durable, filter_subject
        self.source = source
        self.sem = asyncio.Semaphore(concurrency)
        self.in_progress_s = min(in_progress_s, bus.ack_wait_s / 3)
        self._tasks: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self.dead_letters = DeadLetterWatcher(bus, stream=stream, durable=durable, source=source)

    async def run(self) -> None:
        """Fetch and dispatch until :meth:`stop`; fail the futures of dead letters meanwhile."""
        sub = await self.bus.work_consumer(self.stream, self.durable, self.filter_subject)
        await self.dead_letters.start()
        while not self._stopping.is_set():
            await self.sem.acquire()
            self.sem.release()
            try:
                msgs = await sub.fetch(batch=32, timeout=1.0)
            except (NatsTimeout, asyncio.TimeoutError):
                continue
            except Exception as exc:  # noqa: BLE001 - reconnects etc.
                if self._stopping.is_set():
                    break
                log.warning("fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await self.sem.acquire()
                t = asyncio.create_task(self._process(msg))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

    async def _process(self, msg) -> None:
        ticker = asyncio.create_task(self._keep_alive(msg))
        event = None
        try:
            try:
                event = events.from_headers_body(dict(msg.headers or {}), msg.data)
            except Exception as exc:  # noqa: BLE001 - poison message: drop it
                log.error("dropping a message that is not a CloudEvent: %s", exc)
                await msg.term()
                return
            if testhooks.enabled():  # tests only: OPENRL_TEST_HOLD_FILE (openrl/testhooks.py)
                parts = str(event.get_type()).split(".")  # dev.openrl.<op>.v1
                await testhooks.hold_async("handle:" + (parts[2] if len(parts) == 4 else ""))
            await handle_event(self.function, event, source=self.source,
                               deliver=lambda result: store_result(self.bus, result))
            await msg.ack()
        except Exception:  # noqa: BLE001
            await self._failed_in_binding(msg, event)
        finally:
            ticker.cancel()
            self.sem.release()

    async def _failed_in_binding(self, msg, event) -> None:
        """Redeliver a request whose handling failed outside the Function (e.g. storing its
        result while NATS restarts); on its last delivery fail its future and drop it."""
        try:
            delivered = msg.metadata.num_delivered
        except Exception:  # noqa: BLE001
            delivered = 0
        try:
            if event is not None and delivered >= self.bus.max_deliver:
                log.exception("request failed in the binding on its last delivery (%d)", delivered)
                await give_up(self.bus, event, delivered, source=self.source)
                await msg.term()
            else:
                log.exception("request failed in the binding; it will be redelivered")
                await msg.nak(delay=1.0)
        except Exception as exc:  # noqa: BLE001 - NATS down: the ack wait redelivers it
            log.warning("could not nak/fail the request: %s", exc)

    async def _keep_alive(self, msg) -> None:
        while True:
            await asyncio.sleep(self.in_progress_s)
            try:
                await msg.in_progress()
            except Exception as exc:  # noqa: BLE001 - e.g. NATS restarting: keep ticking, it reconnects
                log.debug("in-progress ack failed (retrying): %s", exc)

    async def stop(self, drain_s: float = 30.0) -> None:
        """Stop fetching and wait up to ``drain_s`` seconds for requests in flight."""
        self._stopping.set()
        await self.dead_letters.stop()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=drain_s)
