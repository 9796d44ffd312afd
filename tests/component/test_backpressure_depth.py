"""The gateway's backpressure check (``Gateway.over_limit``) against a real nats-server
(JetStream, 127.0.0.1): a 429 is only answered on a reading of the stream taken after this
replica's last publish, so a request that left the queue between readings never turns the
next one away. No worker runs: the test acks the requests itself through a pull consumer."""

from __future__ import annotations

from functions.gateway.context import Gateway, GatewaySettings
from openrl.transport.bus import SAMPLE_STREAM, Bus, sample_subject
from openrl.transport.local_servers import PortHold, start_nats

LIMIT = 3


async def _publish(g: Gateway, n: int, first: int = 0) -> None:
    for i in range(first, first + n):
        assert await g.submit("sample", f"s:sample:0:{i}", "s", {"i": i})


async def test_an_acked_request_frees_its_place_before_the_next_reading(tmp_path):
    """Limit 3, readings every hour (so only the confirm-before-reject reading can happen):
    3 publishes fill the queue (429 on a fresh reading); one acked frees a place at once;
    the estimate then sits at the limit again after one more publish and is confirmed by
    reading JetStream (3 messages: full). Before, the estimate counted the acked request
    until the next timed reading and answered 429 with 2 requests queued."""
    hold = PortHold()
    proc = start_nats(tmp_path, hold.port)
    bus = await Bus(f"nats://127.0.0.1:{hold.port}").connect()
    try:
        g = Gateway(bus, registry=None, storage=None,
                    settings=GatewaySettings(max_pending_samples=LIMIT, pending_refresh_s=3600.0))
        sub = await bus.work_consumer(SAMPLE_STREAM, "test-sampler", sample_subject("sample"))
        assert not await g.over_limit(SAMPLE_STREAM)
        await _publish(g, LIMIT)
        assert await g.over_limit(SAMPLE_STREAM)  # confirmed: JetStream holds 3
        assert g._depth[SAMPLE_STREAM][0] == LIMIT
        assert await g.over_limit(SAMPLE_STREAM)  # still full, no publish since: the same reading

        (msg,) = await sub.fetch(1, timeout=10)
        await msg.ack_sync()  # one request answered: 2 left in the stream
        # the estimate (3, read before the ack) has no publish behind it: it is not re-read
        # until the hour is over, so the place frees on the next publish's confirmation
        await _publish(g, 1, first=LIMIT)  # 3 in the stream, estimate 4
        assert await g.over_limit(SAMPLE_STREAM)  # re-read: 3 >= 3
        assert g._depth[SAMPLE_STREAM][0] == LIMIT

        for m in await sub.fetch(2, timeout=10):
            await m.ack_sync()  # 1 left
        await _publish(g, 1, first=LIMIT + 1)  # estimate 4 > limit, truth 2
        assert not await g.over_limit(SAMPLE_STREAM)  # the reading admits it
        assert g._depth[SAMPLE_STREAM][0] == 2
    finally:
        await bus.close()
        proc.terminate()
        proc.wait(timeout=30)
        hold.close()
