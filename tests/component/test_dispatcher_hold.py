"""The local push dispatcher (the stand-in for Knative's JetStream channel dispatcher) holds an
event while its receiver refuses connections, as Knative's activator holds a request while a
revision starts, instead of spending its retries in ~6 s and dead-lettering it. Found by the
chaos soak: after several trainer deaths in a row the supervisor waits up to 30 s before the
restart, and every training request sent meanwhile failed with category "server".

Real nats-server and JetStream; the receiver and the gateway's sinks are small HTTP servers on
127.0.0.1 (a function's receiver is what the HTTP binding serves; only its answer matters here).
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from nats_helpers import nats_url  # noqa: F401  (fixture)
from openrl.contract import events, topology
from openrl.transport.bindings.dispatcher import Dispatcher
from openrl.transport.bus import Bus
from openrl.transport.local_servers import PortHold


class Sink:
    """An HTTP server on 127.0.0.1:``port`` (0: any free port; ``server.server_port`` says which)
    recording the bodies POSTed to it; answers ``reply`` (status, body)."""

    def __init__(self, port: int = 0, reply: tuple[int, bytes] = (202, b"")):
        self.got: list[tuple[str, bytes]] = []
        sink = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                sink.got.append((self.path, body))
                self.send_response(reply[0])
                self.send_header("ce-type", "dev.openrl.result.v1")
                self.end_headers()
                self.wfile.write(reply[1])

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), H)  # SO_REUSEADDR: binds a held port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


async def _run(nats_url: str, *, receiver_after_s: float | None, unreachable_s: float) -> tuple[list, list]:
    bus = await Bus(nats_url).connect()
    # the receiver's port is known up front and refuses connections until its server binds it
    target = PortHold()
    target_port = target.port
    gw = Sink()
    gateway = f"http://127.0.0.1:{gw.server.server_port}"
    c = topology.consumer("sampler", 0).as_dict()
    c.pop("source")
    d = Dispatcher(bus, **c, target=f"http://127.0.0.1:{target_port}", reply_to=f"{gateway}/events/result",
                   dead_letter=f"{gateway}/events/dead-letter", retries=2, backoff_s=0.05,
                   unreachable_s=unreachable_s, internal_token="")
    ev = events.request_event("sample", "req-1", "sess-1", {"x": 1})
    headers, body = events.to_headers_body(ev)
    await bus.publish(topology.subject_for("sample"), headers, body, "req-1")
    task = asyncio.create_task(d.run())
    receiver = None
    try:
        if receiver_after_s is not None:  # retries x backoff is ~0.15 s: the receiver comes up long after
            await asyncio.sleep(receiver_after_s)
            receiver = Sink(target_port, reply=(200, b'{"ok": true}'))
        for _ in range(200):
            if gw.got:
                break
            await asyncio.sleep(0.05)
        return list(gw.got), list(receiver.got if receiver else [])
    finally:
        await d.stop()
        task.cancel()
        await bus.close()
        gw.close()
        if receiver:
            receiver.close()
        target.close()


def test_an_event_waits_for_a_restarting_receiver(nats_url):
    sinks, delivered = asyncio.run(_run(nats_url, receiver_after_s=2.0, unreachable_s=30))
    assert [p for p, _ in delivered] == ["/"] and json.loads(delivered[0][1]) == {"x": 1}
    assert [p for p, _ in sinks] == ["/events/result"]  # answered, not dead-lettered


def test_a_receiver_that_never_comes_is_dead_lettered_after_the_hold(nats_url):
    sinks, _ = asyncio.run(_run(nats_url, receiver_after_s=None, unreachable_s=1.0))
    assert [p for p, _ in sinks] == ["/events/dead-letter"]
