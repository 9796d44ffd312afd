"""Helpers the stack and component tests share for a real nats-server: the ``nats_url``
fixture (a nats-server of one test's own), the depth of a JetStream stream, and waiting for a
condition. Import the fixture where it is used (``from nats_helpers import nats_url  # noqa: F401``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from openrl.transport.local_servers import PortHold, start_nats


@pytest.fixture
def nats_url(tmp_path):
    """``nats://127.0.0.1:<port>`` of a nats-server (JetStream, state under ``tmp_path``) that
    lives for one test."""
    with PortHold() as hold:  # a free port, held until the server is gone
        proc = start_nats(tmp_path, hold.port)
        yield f"nats://127.0.0.1:{hold.port}"
        proc.terminate()
        proc.wait(timeout=30)


def stream_depth(nats_url: str, stream: str) -> int:
    """Messages held by JetStream stream ``stream`` now (a work queue's requests not yet acked)."""
    import nats

    async def go() -> int:
        nc = await nats.connect(nats_url)
        try:
            return (await nc.jetstream().stream_info(stream)).state.messages
        finally:
            await nc.close()

    return asyncio.run(go())


def wait_until(cond, timeout_s: float, what: str, poll_s: float = 0.1) -> None:
    """Poll ``cond()`` until it is true.

    Raises:
        AssertionError: ``what``, when ``timeout_s`` seconds passed first.
    """
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(poll_s)
