"""A small stand-in for Knative Eventing's dispatcher, for local push runs.

It consumes a JetStream work stream and POSTs each request CloudEvent (binary mode) to a
function's HTTP receiver, exactly as Knative's NATS JetStream channel dispatcher does;
the reply (a result CloudEvent) is POSTed to the gateway's ``/events/result`` sink.
Failed deliveries (5xx, a connection cut mid-request) are retried with exponential backoff up
to ``retries`` times. A receiver that does not accept the connection at all (its process is
restarting or starting: the embedded stack's supervisor backs off up to 30 s) is waited for up
to ``unreachable_s`` (120 s) without using up retries, as Knative's activator holds a request
while a revision comes up. After that the event goes to the dead-letter subject
``openrl.deadletter.<op>`` and to the gateway's ``/events/dead-letter`` sink, which
fails the future with category "server".

    python -m openrl.transport.bindings.dispatcher --nats URL --gateway http://127.0.0.1:8000 \
        --route trainer=http://127.0.0.1:8081 --route sampler=http://127.0.0.1:8082
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import httpx
from nats.errors import TimeoutError as NatsTimeout

from openrl.config import Settings
from openrl.contract import events, topology
from openrl.transport.bus import Bus

log = logging.getLogger("openrl.dispatcher")


class Dispatcher:
    """Push every message of one consumer to ``target`` (a function's receiver URL).

    Args:
        bus: connected Bus.
        stream / durable / filter_subject: the JetStream consumer (a Knative subscription).
        target: the function's receiver URL.
        reply_to: the URL result events are POSTed to.
        dead_letter: the URL undeliverable requests are POSTed to.
        retries: delivery attempts after the first; backoff ``backoff_s · 2^n`` seconds.
        unreachable_s: seconds to keep retrying (every ``backoff_s`` doubling up to 2 s, not
            counted in ``retries``) while the receiver refuses connections.
        timeout_s: HTTP timeout of one delivery (a training step can be long).
        internal_token: shared secret sent (``X-OpenRL-Internal-Token``) to the gateway's
            ``/events/*`` sinks; default ``Settings().internal_token`` (``$OPENRL_INTERNAL_TOKEN``).
    """

    def __init__(self, bus: Bus, *, stream: str, durable: str, filter_subject: str, target: str, reply_to: str,
                 dead_letter: str, retries: int = 5, backoff_s: float = 0.2, timeout_s: float = 600.0,
                 unreachable_s: float = 120.0,
                 concurrency: int = 256, internal_token: str | None = None):
        self.bus, self.stream, self.durable, self.filter_subject = bus, stream, durable, filter_subject
        self.target, self.reply_to, self.dead_letter = target, reply_to, dead_letter
        self.retries, self.backoff_s, self.unreachable_s = retries, backoff_s, unreachable_s
        self.internal_token = internal_token if internal_token is not None else Settings().internal_token
        self.client = httpx.AsyncClient(timeout=timeout_s)
        self.sem = asyncio.Semaphore(concurrency)
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        """Fetch and deliver messages (each in its own task, at most ``concurrency`` at once) until :meth:`stop`."""
        sub = await self.bus.work_consumer(self.stream, self.durable, self.filter_subject)
        while not self._stop.is_set():
            try:
                msgs = await sub.fetch(batch=32, timeout=1.0)
            except (NatsTimeout, asyncio.TimeoutError):
                continue
            for msg in msgs:
                await self.sem.acquire()
                t = asyncio.create_task(self._deliver(msg))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

    async def _post(self, url: str, headers: dict, body: bytes) -> httpx.Response:
        token = self.internal_token
        if token and url in (self.reply_to, self.dead_letter):  # the gateway's /events/* sinks (openrl/edge/auth.py)
            headers = {**headers, "X-OpenRL-Internal-Token": token}
        return await self.client.post(url, headers=headers, content=body)

    async def _deliver(self, msg) -> None:
        try:
            headers = dict(msg.headers or {})
            headers.pop("Nats-Msg-Id", None)
            r = await self._attempts(msg, headers)
            if r is None:
                await self._dead_letter(msg, headers)
                await msg.ack()
                return
            if r.status_code == 200 and r.content:
                await self._post(self.reply_to, dict(r.headers), r.content)
            elif r.status_code >= 400:
                # a 4xx means the receiver rejected the envelope itself: dead-letter it
                await self._dead_letter(msg, headers)
            await msg.ack()
        except Exception:  # noqa: BLE001
            log.exception("dispatch failed; the message will be redelivered")
        finally:
            self.sem.release()

    async def _attempts(self, msg, headers: dict) -> httpx.Response | None:
        """POST the event until the receiver answers below 500; None when ``retries`` failed
        attempts are used up, or the receiver refused connections for ``unreachable_s``."""
        loop = asyncio.get_running_loop()
        attempt, refused_since, waits = 0, None, 0
        while True:
            try:
                r = await self._post(self.target, headers, msg.data)
                if r.status_code < 500:
                    return r
                refused_since = None
            except httpx.ConnectError as exc:  # nothing listening: the receiver is (re)starting
                now = loop.time()
                refused_since = now if refused_since is None else refused_since
                if now - refused_since < self.unreachable_s:
                    if waits == 0:
                        log.warning("%s refuses connections (%s); holding the event up to %.0f s",
                                    self.target, exc, self.unreachable_s)
                    await asyncio.sleep(min(self.backoff_s * 2**min(waits, 10), 2.0))
                    waits += 1
                    await msg.in_progress()
                    continue
                log.warning("%s refused connections for %.0f s", self.target, now - refused_since)
            except httpx.HTTPError as exc:
                log.warning("delivery to %s failed: %s", self.target, exc)
            if attempt >= self.retries:
                return None
            await asyncio.sleep(self.backoff_s * 2**attempt)
            attempt += 1
            await msg.in_progress()

    async def _dead_letter(self, msg, headers: dict) -> None:
        ev = events.from_headers_body(headers, msg.data)
        await self.bus.nc.publish(topology.deadletter_subject(events.op_of(ev)), msg.data, headers=headers)
        await self._post(self.dead_letter, headers, msg.data)

    async def stop(self) -> None:
        """Stop fetching, wait up to 30 s for deliveries in flight, close the HTTP client."""
        self._stop.set()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=30)
        await self.client.aclose()


async def serve(nats_url: str, gateway: str, routes: dict[str, str]) -> None:
    """Run one :class:`Dispatcher` per route (function name -> receiver URL, bound to that
    function's consumer in :mod:`openrl.contract.topology`) until SIGTERM / SIGINT."""
    bus = await Bus(nats_url).connect()
    ds = []
    for name, target in routes.items():
        # the same durable consumer a JetStream worker would bind: a work-queue stream allows
        # one consumer per subject, and either binding may serve it
        c = topology.consumer(name, 0).as_dict()
        c.pop("source")
        ds.append(Dispatcher(bus, **c, target=target, reply_to=f"{gateway}/events/result",
                             dead_letter=f"{gateway}/events/dead-letter"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(d.run()) for d in ds]
    for t in tasks:
        t.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                            or log.error("dispatcher stopped: %r", t.exception()))
    print("[dispatcher] ready", flush=True)
    await stop.wait()
    for d in ds:
        await d.stop()
    for t in tasks:
        t.cancel()
    await bus.close()


def main(argv: list[str] | None = None) -> None:
    """Command line: see the module doc."""
    ap = argparse.ArgumentParser(prog="python -m openrl.transport.bindings.dispatcher")
    ap.add_argument("--nats", required=True)
    ap.add_argument("--gateway", required=True, help="gateway base URL (result and dead-letter sinks)")
    ap.add_argument("--route", action="append", default=[], help="trainer=URL or sampler=URL")
    args = ap.parse_args(argv)
    from openrl.observe import logs

    logs.setup("dispatcher")
    asyncio.run(serve(args.nats, args.gateway, dict(r.split("=", 1) for r in args.route)))


if __name__ == "__main__":
    main()
