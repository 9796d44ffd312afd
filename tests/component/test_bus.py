"""openrl.transport.bus against a real nats-server (JetStream, file storage, 127.0.0.1): listing KV keys."""

from __future__ import annotations

import asyncio

from openrl.transport.bus import FUTURES_BUCKET, META_BUCKET, Bus
from openrl.transport.local_servers import PortHold, start_nats


async def test_kv_keys_lists_every_live_key_even_under_concurrent_writes(tmp_path):
    """Bus.kv_keys / meta_list: an empty bucket gives []; 3,000 futures are all listed, five
    times in a row while other keys are being written; deleted keys are left out; a prefix
    is filtered by the server (one matching nothing answers at once). nats-py's own
    ``KeyValue.keys()`` races its end marker against the deliveries and could miss them all."""
    hold = PortHold()  # a free port, held until the server is gone
    port = hold.port
    nats = start_nats(tmp_path, port)
    bus = await Bus(f"nats://127.0.0.1:{port}").connect()
    try:
        assert await bus.kv_keys(FUTURES_BUCKET) == [] and await bus.meta_list("model") == []
        for i in range(3000):
            await bus.future_create(f"s:sample:0:{i}", "sample")
        for name in ("m1", "m2", "m3"):
            await bus.meta_put({"model_id": name}, "model", name)
        await bus.meta_put({"session_id": "s"}, "session", "s")
        await bus.meta_delete("model", "m2")

        async def writer():
            for i in range(200):
                await bus.meta_put({"n": i}, "noise", str(i))

        w = asyncio.create_task(writer())
        for _ in range(5):
            assert len(await bus.kv_keys(FUTURES_BUCKET)) == 3000
            assert sorted(r["model_id"] for r in await bus.meta_list("model")) == ["m1", "m3"]
            assert await bus.meta_list("session") == [{"session_id": "s"}]
            assert await bus.meta_list("nothing-here") == []
        await w
        assert len(await bus.kv_keys(META_BUCKET)) == 3 + 200
    finally:
        await bus.close()
        nats.terminate()
        nats.wait(timeout=30)
        hold.close()
