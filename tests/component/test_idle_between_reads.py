"""A worker that handles each request between two of the supervisor's reads is busy, not idle
(openrl/transport/supervisor.py, "Scale to zero").

The H100 autoresearch sweep (docs/benchmarks.md, fifteenth session) had its sampler stopped under
load at ``--idle-timeout 30``: every sample of 6 tokens was pulled, answered and acked within the
0.5 s between two ``consumer_info`` reads, so each read saw nothing pending or unacked. The
supervisor now also counts a moved ``delivered.consumer_seq`` as work.

A real nats-server, the real Bus and work consumer, requests published as the gateway publishes
them, and the real :class:`Supervisor` ``tick``. The worker process is a stand-in (``sleep``); this
test's own pull and ack on the real consumer are its work.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

from nats_helpers import nats_url  # noqa: F401  (fixture)
from openrl.contract import events, topology
from openrl.transport.bus import Bus
from openrl.transport.supervisor import RUNNING, STOPPING, Managed, Supervisor

IDLE_S = 30.0


async def _publish_sample(bus: Bus, rid: str) -> None:
    ev = events.request_event("sample", rid, "sess", {"base_model": "M", "prompt_tokens": [1]})
    await bus.future_create(rid, "sample")
    await bus.publish(topology.subject_for("sample", "0"), *events.to_headers_body(ev), msg_id=rid)


def test_requests_handled_between_reads_keep_the_worker_busy(nats_url, tmp_path):  # noqa: F811
    worker = subprocess.Popen(["sleep", "600"])
    c = topology.consumer("sampler")
    sampler = Managed("sampler", lambda: worker, slot=0, consumer=(c.stream, c.durable), state=RUNNING)
    sup = Supervisor([sampler], [worker], nats_url=nats_url, state_file=tmp_path / "supervisor.json",
                     idle_timeout_s=IDLE_S)

    async def go():
        bus = await Bus(nats_url).connect()
        try:
            sub = await bus.work_consumer(c.stream, c.durable, c.filter_subject)
            await sup.tick(bus.js, bus.nc)                  # the first read: nothing delivered yet
            for i in range(3):
                sampler.last_busy = time.monotonic() - IDLE_S + 5  # 25 s without a read that saw work
                await _publish_sample(bus, f"sess:sample:{i}")
                for m in await sub.fetch(batch=1, timeout=10):  # pulled, answered, acked between reads
                    await m.ack_sync()  # acked before the read (a worker's ack lands within ms)
                info = await bus.js.consumer_info(c.stream, c.durable)
                assert info.num_pending == 0 and info.num_ack_pending == 0  # what the read alone saw
                await sup.tick(bus.js, bus.nc)
                assert time.monotonic() - sampler.last_busy < 2, "the handled request did not count as work"
                assert sampler.state == RUNNING and worker.poll() is None
                assert sampler.delivered == i + 1
            # no new delivery for the whole grace: idle, stopped
            sampler.last_busy = time.monotonic() - IDLE_S - 1
            await sup.tick(bus.js, bus.nc)
            assert sampler.state == STOPPING
            assert worker.wait(timeout=10) == -signal.SIGTERM
        finally:
            await bus.close()

    try:
        asyncio.run(go())
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
