"""Run one Function as a JetStream worker process.

    python -m openrl.worker functions.trainer --nats nats://127.0.0.1:4222 [--shard 0]
    python -m openrl.worker functions.sampler --nats nats://127.0.0.1:4222

Logs are JSON lines (:mod:`openrl.logs`); Prometheus metrics are served on
``--metrics-port`` / ``$OPENRL_METRICS_PORT`` (0 = off, :mod:`openrl.metrics`); traces are
exported when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (:mod:`openrl.tracing`).

SIGTERM / SIGINT stop fetching, drain requests in flight (up to ``--drain-s`` seconds),
then call the Function's ``stop()``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal

from openrl.bindings import load_function
from openrl.bindings.jetstream import JetStreamWorker
from openrl.bus import SAMPLE_STREAM, TRAIN_STREAM, Bus


def consumer_for(module: str, shard: int) -> dict:
    """Stream, durable consumer name and subject filter of a function module."""
    if module.endswith("trainer"):
        return {"stream": TRAIN_STREAM, "durable": f"trainer-{shard}", "filter_subject": f"openrl.train.{shard}.>",
                "source": "/openrl/trainer"}
    if module.endswith("sampler"):
        return {"stream": SAMPLE_STREAM, "durable": "sampler", "filter_subject": "openrl.sample.>",
                "source": "/openrl/sampler"}
    raise ValueError(f"no JetStream consumer is defined for {module!r}")


async def serve(module: str, nats_url: str, shard: int, cfg: dict, drain_s: float) -> None:
    fn = load_function(module)
    await fn.start(cfg)
    bus = await Bus(nats_url).connect()
    worker = JetStreamWorker(fn, bus, **consumer_for(module, shard))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    run = asyncio.create_task(worker.run())
    print(f"[{module}] ready", flush=True)
    await stop.wait()
    await worker.stop(drain_s)
    run.cancel()
    await fn.stop()
    await bus.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m openrl.worker")
    ap.add_argument("module", help="function module, e.g. functions.trainer")
    ap.add_argument("--nats", default=None, help="NATS URL (default $OPENRL_NATS_URL)")
    ap.add_argument("--shard", type=int, default=0, help="trainer shard served by this process")
    ap.add_argument("--config", default="{}", help="JSON config passed to the Function's start()")
    ap.add_argument("--drain-s", type=float, default=30.0)
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="serve Prometheus /metrics on this port (default $OPENRL_METRICS_PORT; 0 = off)")
    args = ap.parse_args(argv)
    from openrl import logs, metrics, tracing

    name = args.module.split(".")[-1]
    logs.setup(name)
    tracing.setup(f"openrl-{name}")
    port = metrics.serve(args.metrics_port)
    if port:
        logging.getLogger("openrl.worker").info("metrics on :%d/metrics", port)
    try:
        asyncio.run(serve(args.module, args.nats, args.shard, json.loads(args.config), args.drain_s))
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
