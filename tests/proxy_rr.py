"""A round-robin HTTP reverse proxy for tests (issue 17 item 3: two gateway replicas).

Each request goes to the next upstream in turn (request 1 to upstream 0, request 2 to
upstream 1, ...), so consecutive SDK calls (a submit and its ``retrieve_future``, a session's
create and its heartbeat) land on different replicas. An upstream that refuses the
connection (a killed gateway) is skipped: the request is sent to the next one, and the
skip is counted. Bodies are buffered (the Tinker API has no streaming responses);
long polls wait as long as the upstream does.

Usage::

    with RoundRobinProxy(["http://127.0.0.1:8001", "http://127.0.0.1:8002"]) as proxy:
        tinker.ServiceClient(base_url=proxy.url, ...)
        proxy.hits  # [(upstream index, method, path), ...]
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
       "content-length", "host"}
RESPONSE_DROP = HOP | {"content-encoding"}  # httpx hands the body over decoded


class RoundRobinProxy:
    """A proxy on 127.0.0.1:``port`` (0: a free one) alternating over ``upstreams``
    (base URLs). ``hits``: ``(upstream index, method, path)`` of every forwarded request;
    ``skips``: connection attempts refused by an upstream (then tried on the next)."""

    def __init__(self, upstreams: list[str], port: int = 0):
        self.upstreams = list(upstreams)
        # bound and listening here, served by uvicorn from start(): the port is ours from the start
        self._sock = socket.create_server(("127.0.0.1", port))
        self.port: int = self._sock.getsockname()[1]
        self.hits: list[tuple[int, str, str]] = []
        self.skips = 0
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _forward(self, request: Request) -> Response:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
        with self._lock:
            first = next(self._turn)
        last_exc: Exception | None = None
        for k in range(len(self.upstreams)):
            i = (first + k) % len(self.upstreams)
            url = self.upstreams[i] + request.url.path + (f"?{request.url.query}" if request.url.query else "")
            try:
                r = await self._client.request(request.method, url, content=body, headers=headers)
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:  # dead (or dying) upstream: next
                with self._lock:
                    self.skips += 1
                last_exc = exc
                continue
            with self._lock:
                self.hits.append((i, request.method, request.url.path))
            out = [(k2, v) for k2, v in r.headers.items() if k2.lower() not in RESPONSE_DROP]
            return Response(r.content, status_code=r.status_code, headers=dict(out))
        return Response(f"no upstream answered: {last_exc}", status_code=502)

    def start(self, timeout_s: float = 30.0) -> "RoundRobinProxy":
        """Serve on a background thread; returns once the server accepts connections.

        Raises:
            RuntimeError: the server did not start within ``timeout_s`` seconds.
        """
        app = Starlette(routes=[Route("/{path:path}", self._forward,
                                      methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])])
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None, lifespan="off"))
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[self._sock])),
                                        daemon=True, name="rr-proxy")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the round-robin proxy on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._sock.close()  # uvicorn closes it when it shuts down; this covers a proxy never started

    def __enter__(self) -> "RoundRobinProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
