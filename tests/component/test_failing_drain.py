"""A failing function's queue (openrl/transport/supervisor.py, openrl/transport/startfailures.py):
while a worker cannot start, the supervisor fails every queued request's future with category
"server" and the start error, keeps the seq_ids of the training requests it drained, and
publishes them as skips once the worker pulls again.

A real nats-server, the real Bus, requests published as the gateway publishes them, and the
real :class:`Supervisor` ``tick``. The worker processes are stand-ins (``true`` that has exited:
a dead worker between two start attempts; ``sleep``: a started one); the "worker" that pulls
after the recovery is this test's own pull on the real consumer.
"""

from __future__ import annotations

import asyncio
import json
import subprocess

from nats_helpers import nats_url  # noqa: F401  (fixture)
from openrl.contract import events, topology
from openrl.transport.bindings.deadletter import publish_skip
from openrl.transport.bus import Bus
from openrl.transport.supervisor import RESTARTING, RUNNING, STARTING, Managed, Supervisor

CAUSE = "RegistryError: model registry /s/models.toml is not valid TOML: Expected '=' (at line 1, column 5)"


async def _request(bus: Bus, op: str, rid: str, subject: str, data: dict, shard: str = "0") -> None:
    """Create the pending future and publish the request event, as the gateway does."""
    ext = {"trainershard": shard} if topology.function_of_op(op) == topology.TRAINER else {}
    ev = events.request_event(op, rid, subject, data, extensions=ext)
    await bus.future_create(rid, op)
    await bus.publish(topology.subject_for(op, shard), *events.to_headers_body(ev), msg_id=rid)


def _error(rec) -> dict:
    assert rec is not None and rec.state == "error", rec
    return json.loads(rec.body)


def test_a_failing_function_fails_its_queue_and_skips_the_drained_seq_ids_once_up(nats_url, tmp_path):  # noqa: F811
    dead = subprocess.Popen(["true"])
    dead.wait()
    procs = [dead, dead]
    trainer = Managed("trainer", lambda: dead, slot=0, consumer=("OPENRL_TRAIN", "trainer-0"), state=RESTARTING,
                      log=tmp_path / "trainer.log")
    sampler = Managed("sampler", lambda: dead, slot=1, consumer=("OPENRL_SAMPLE", "sampler"), state=RESTARTING)
    sampler.restart_at = trainer.restart_at = float("inf")  # between two start attempts
    trainer.failing = sampler.failing = CAUSE
    trainer.any_start_fails = sampler.any_start_fails = 3
    sup = Supervisor([trainer, sampler], procs, nats_url=nats_url, state_file=tmp_path / "supervisor.json",
                     failing_retry_s=60, ack_wait_s=3)

    async def go():
        bus = await Bus(nats_url, ack_wait_s=3).connect()
        try:
            await _request(bus, "sample", "sess:sample:1", "sess", {"base_model": "M", "prompt_tokens": [1]})
            await _request(bus, "create_model", "run1:0", "run1", {"base_model": "M"})
            await _request(bus, "optim_step", "run1:3", "run1", {"seq_id": 3, "adam_params": {}})
            await publish_skip(bus, "run1", 5, "0")  # a seq_id the gateway rejected meanwhile
            await sup.tick(bus.js, bus.nc)

            s = _error(await bus.future_get("sess:sample:1"))
            assert s["category"] == "server"
            assert s["error"] == f"the sampler worker cannot start: {CAUSE} (3 failed starts in a row; openrl " \
                                 "serve tries again every 60 s)"
            for rid in ("run1:0", "run1:3"):
                t = _error(await bus.future_get(rid))
                assert t["category"] == "server" and t["error"].startswith(f"the trainer worker cannot start: {CAUSE}")
                assert "trainer.log" in t["error"]
            for name in ("OPENRL_TRAIN", "OPENRL_SAMPLE"):
                assert (await bus.js.stream_info(name)).state.messages == 0
            assert trainer.skips == {("run1", 3, "0"), ("run1", 5, "0")}
            assert trainer.failed_requests == 2 and sampler.failed_requests == 1
            state = {p["name"]: p for p in json.loads((tmp_path / "supervisor.json").read_text())["processes"]}
            assert state["trainer"]["state"] == "failing" and state["trainer"]["error"] == CAUSE
            assert state["trainer"]["failed_requests"] == 2

            # the cause is gone: a start attempt whose worker pulls
            live = subprocess.Popen(["sleep", "600"])
            try:
                procs[0] = live
                trainer.state, trainer.drained_at = STARTING, 0.0
                sub = await bus.work_consumer("OPENRL_TRAIN", "trainer-0", "openrl.train.0.>")
                pulled = asyncio.create_task(sub.fetch(batch=2, timeout=20))  # the worker's pull
                for _ in range(100):
                    if (await bus.js.consumer_info("OPENRL_TRAIN", "trainer-0")).num_waiting:
                        break
                    await asyncio.sleep(0.05)
                await sup.tick(bus.js, bus.nc)
                assert trainer.state == RUNNING and trainer.failing is None and trainer.skips == set()
                got = await pulled
                while len(got) < 2:  # a pull may be answered with fewer messages than its batch
                    got += await sub.fetch(batch=2 - len(got), timeout=20)
                skipped = sorted(events.data_json(events.from_headers_body(dict(m.headers), m.data))["seq_id"]
                                 for m in got)
                assert skipped == [3, 5]
                for m in got:
                    await m.ack()
                assert sampler.failing == CAUSE  # the other function is still failing
            finally:
                live.kill()
                live.wait()
        finally:
            await bus.close()

    asyncio.run(go())
