"""Issue 34, item 1: a request that outlasts Knative's response-start limit still completes its
future exactly once.

On Knative, queue-proxy (in the function's pod) and the activator (which holds a request while
a revision scales from zero) answer ``504`` when no response byte came within the revision's
``responseStartTimeoutSeconds``; the HTTP binding answers only when the handler is done, and the
Trigger's retry then delivers the same CloudEvent again. docs/knative-review.md ("Request
limits") gives the decision: the limit is the whole ``timeoutSeconds`` on every function, the
Trigger's retries absorb a scale from zero longer than one attempt, and the binding joins a
redelivered event to its running handler instead of starting the work again.

What runs here: the real push dispatcher (:mod:`openrl.transport.bindings.dispatcher`, the
stand-in for Knative's JetStream channel dispatcher: retries with backoff, a 5xx is retried)
on a real nats-server; :class:`ResponseStartProxy`, a test-sized stand-in for queue-proxy and
the activator (answers 504 when the upstream sent no response headers within ``limit_s``, and
holds a request while the upstream refuses connections, as the activator does while no pod is
up); the real HTTP binding (:func:`openrl.transport.bindings.http.create_app`, served by uvicorn)
around a Function whose handler is slower than the limit; and the gateway's two sinks, which
store a result in the real futures bucket (:func:`openrl.transport.bindings.results.store_result`,
as the gateway's ``/events/result`` does). Servers bind port 0, or a socket bound before anything
is told its port.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from nats_helpers import nats_url  # noqa: F401  (fixture)
from openrl.contract import events, topology
from openrl.transport.bindings.dispatcher import Dispatcher
from openrl.transport.bindings.http import create_app
from openrl.transport.bindings.results import store_result
from openrl.transport.bus import Bus

SOURCE = "/openrl/slowfake"
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length", "host"}


class SlowFunction:
    """A Function whose ``handle`` takes ``handle_s`` seconds and answers which call it was."""

    def __init__(self, handle_s: float):
        self.handle_s = handle_s
        self.calls: list[str] = []
        self.finished = 0

    async def start(self, cfg):
        pass

    async def stop(self):
        pass

    def alive(self):
        return True

    def ready(self):
        return True

    async def handle(self, event):
        self.calls.append(event.get_id())
        n = len(self.calls)
        await asyncio.sleep(self.handle_s)
        self.finished += 1
        return events.result_event(event, {"call": n}, source=SOURCE)


def _socket() -> socket.socket:
    """A TCP socket bound to a free port of 127.0.0.1, not listening yet (connections are refused
    until a server listens on it)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


class Served:
    """An ASGI app served by uvicorn in this event loop on ``sock`` (see :func:`_socket`)."""

    def __init__(self, app, sock: socket.socket | None = None):
        self.sock = sock or _socket()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None,
                                                    timeout_graceful_shutdown=1))
        self.task: asyncio.Task | None = None

    async def start(self) -> "Served":
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            assert not self.task.done(), self.task.exception()
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        if self.task is not None:
            self.server.should_exit = True
            await asyncio.wait_for(self.task, 10)
        self.sock.close()


class ResponseStartProxy:
    """Queue-proxy's and the activator's response-start limit, test-sized: forwards ``POST /`` to
    ``upstream``; while the upstream refuses connections (no pod yet) it keeps trying, and when
    no response headers came within ``limit_s`` of the request's arrival it answers ``504`` and
    drops the upstream request (Knative cancels it). ``answers``: the status of every request."""

    def __init__(self, upstream: str, limit_s: float):
        self.upstream, self.limit_s = upstream, limit_s
        self.answers: list[int] = []
        self.client = httpx.AsyncClient(timeout=None)
        self.app = Starlette(routes=[Route("/", self.forward, methods=["POST"])])

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
        try:
            async with asyncio.timeout(self.limit_s):
                while True:
                    try:
                        r = await self.client.send(self.client.build_request("POST", self.upstream + "/", content=body,
                                                                             headers=headers), stream=True)
                        break
                    except httpx.ConnectError:  # nothing listens yet: the activator waits for a pod
                        await asyncio.sleep(0.05)
        except TimeoutError:
            self.answers.append(504)
            return Response("activator request timeout", status_code=504)
        try:
            content = await r.aread()
        finally:
            await r.aclose()
        self.answers.append(r.status_code)
        return Response(content, status_code=r.status_code,
                        headers={k: v for k, v in r.headers.items() if k.lower() not in HOP | {"content-encoding"}})


class GatewaySinks:
    """The gateway's ``/events/result`` (stores the result in the futures bucket, as the gateway
    does) and ``/events/dead-letter`` (recorded only). ``got``: ``(path, request id)``."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.got: list[tuple[str, str]] = []
        self.app = Starlette(routes=[Route("/events/result", self.result, methods=["POST"]),
                                     Route("/events/dead-letter", self.dead_letter, methods=["POST"])])

    async def result(self, request: Request) -> Response:
        ev = events.from_headers_body(dict(request.headers), await request.body())
        self.got.append(("/events/result", ev.get_subject()))
        await store_result(self.bus, ev)
        return Response(status_code=202)

    async def dead_letter(self, request: Request) -> Response:
        ev = events.from_headers_body(dict(request.headers), await request.body())
        self.got.append(("/events/dead-letter", ev.get_id()))
        return Response(status_code=202)


async def _deliver_once(nats_url: str, fn: SlowFunction, *, limit_s: float, receiver_after_s: float = 0.0,
                        retries: int = 5) -> tuple[list, list, object]:
    """Publish one sample request and push it through dispatcher -> proxy -> HTTP binding; the
    binding starts listening ``receiver_after_s`` after the publish (a scale from zero). Returns
    (the sinks' records, the proxy's answers, the future's record) once the future is done."""
    bus = await Bus(nats_url).connect()
    gw = GatewaySinks(bus)
    sinks = await Served(gw.app).start()
    receiver = Served(create_app(fn, source=SOURCE))  # bound, not listening: connections refused
    proxy = ResponseStartProxy(receiver.url, limit_s)
    front = await Served(proxy.app).start()
    c = topology.consumer("sampler", 0).as_dict()
    c.pop("source")
    d = Dispatcher(bus, **c, target=front.url, reply_to=f"{sinks.url}/events/result",
                   dead_letter=f"{sinks.url}/events/dead-letter", retries=retries, backoff_s=0.05,
                   timeout_s=60, internal_token="")
    rid = "req-slow-1"
    await bus.future_create(rid, "sample")
    headers, body = events.to_headers_body(events.request_event("sample", rid, "sess-1", {"x": 1}))
    await bus.publish(topology.subject_for("sample"), headers, body, rid)
    run = asyncio.create_task(d.run())
    try:
        await asyncio.sleep(receiver_after_s)
        await receiver.start()
        for _ in range(400):
            rec = await bus.future_get(rid)
            if (rec is not None and rec.state != "pending") or any(p == "/events/dead-letter" for p, _ in gw.got):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(limit_s + 0.5)  # anything still to come (a second result, a late retry) comes now
        return list(gw.got), list(proxy.answers), await bus.future_get(rid)
    finally:
        await d.stop()
        run.cancel()
        for s in (front, receiver, sinks):
            await s.stop()
        await proxy.client.aclose()
        await bus.close()


def test_a_handler_slower_than_the_response_start_limit_completes_its_future_once(nats_url):
    """The handler takes 3 s, the limit is 2 s: the first delivery gets 504 at 2 s, the retry
    (50 ms later) joins the handler still running and answers with its result at 3 s. The
    handler ran once, one result reached the gateway, nothing was dead-lettered, and the future
    holds that result."""
    fn = SlowFunction(handle_s=3.0)
    got, answers, rec = asyncio.run(_deliver_once(nats_url, fn, limit_s=2.0))
    assert fn.calls == ["req-slow-1"] and fn.finished == 1
    assert answers == [504, 200], answers
    assert got == [("/events/result", "req-slow-1")], got
    assert rec.state == "ok" and json.loads(rec.body) == {"call": 1}


def test_a_scale_from_zero_longer_than_the_limit_is_absorbed_by_the_retries(nats_url):
    """No receiver listens for 2.5 s (a revision scaling from zero: node, image, model), the
    activator's limit is 1 s: the first two deliveries are held and answered 504, the third
    reaches the receiver once it is up. One handler call, one result, no dead letter."""
    fn = SlowFunction(handle_s=0.1)
    got, answers, rec = asyncio.run(_deliver_once(nats_url, fn, limit_s=1.0, receiver_after_s=2.5))
    assert fn.calls == ["req-slow-1"]
    assert answers[-1] == 200 and answers[:-1] and set(answers[:-1]) == {504}, answers
    assert got == [("/events/result", "req-slow-1")], got
    assert rec.state == "ok" and json.loads(rec.body) == {"call": 1}


def test_redeliveries_join_the_running_handler_and_survive_a_caller_that_gives_up():
    """At the binding itself (ASGI, no network): a caller cancelled mid-request leaves the handler
    running; a second delivery of the same event joins it (one call, the same answer), a third
    after it finished runs it again (the Function decides what a late duplicate gets: the
    trainer answers from its stored result); the same id with another body runs on its own."""
    fn = SlowFunction(handle_s=0.5)
    app = create_app(fn, source=SOURCE)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://binding") as client:
            ev = events.request_event("sample", "req-join", "sess-1", {"x": 1})
            h, b = events.to_headers_body(ev)
            first = asyncio.create_task(client.post("/", headers=h, content=b))
            await asyncio.sleep(0.1)
            first.cancel()  # the caller gives up (queue-proxy's 504 closes the connection)
            await asyncio.gather(first, return_exceptions=True)
            r2, r3 = await asyncio.gather(client.post("/", headers=h, content=b), client.post("/", headers=h, content=b))
            assert fn.calls == ["req-join"] and fn.finished == 1
            assert r2.status_code == r3.status_code == 200 and json.loads(r2.content) == json.loads(r3.content) == {"call": 1}
            late = await client.post("/", headers=h, content=b)
            assert json.loads(late.content) == {"call": 2}
            other = events.request_event("sample", "req-join", "sess-1", {"x": 2})
            h2, b2 = events.to_headers_body(other)
            r4, r5 = await asyncio.gather(client.post("/", headers=h, content=b), client.post("/", headers=h2, content=b2))
            assert len(fn.calls) == 4 and {json.loads(r4.content)["call"], json.loads(r5.content)["call"]} == {3, 4}

    asyncio.run(go())
