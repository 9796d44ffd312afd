"""What each worker runs on: the JetStream worker's record in the meta bucket, the
``openrl_function_info`` metric, ``GET /api/v1/status`` and the ``openrl status`` table.

A real nats-server and real ``python -m openrl.transport.worker`` processes run tiny fake Functions
(no model, no GPU) whose ``describe()`` says what they run on; the trainer's backend is
``pending`` until its fake "first model load" a moment after start, as a real one's is.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nats_helpers import nats_url  # noqa: F401  (fixture)
from openrl.observe import metrics
from openrl.transport.bus import Bus
from openrl.transport.worker import WORKERS_KEY, WorkerPresence, describe, function_of_consumer, worker_records

ROOT = Path(__file__).resolve().parents[2]

FAKE_FUNCTION = '''
"""A fake Function for tests/component/test_worker_status.py: answers nothing, describes itself."""
import os
import time


class Function:
    def __init__(self):
        self.t0 = None

    async def start(self, cfg):
        self.t0 = time.monotonic()

    async def handle(self, event):
        return None

    async def stop(self):
        pass

    def alive(self):
        return True

    def ready(self):
        return True

    def describe(self):
        loaded = time.monotonic() - self.t0 > float(os.environ.get("FAKE_LOAD_S", "0"))
        return {"device": "cpu", "dtype": "float32" if loaded else None,
                "backend": os.environ["FAKE_BACKEND"] if loaded else "pending"}


def new():
    return Function()
'''


class NoDescribe:
    """A Function without ``describe()`` (an older one)."""


class Broken:
    def describe(self):
        raise RuntimeError("boom")


def test_describe_is_optional_and_never_raises():
    assert describe(NoDescribe()) == {}
    assert describe(Broken()) == {}
    assert function_of_consumer("trainer-12") == ("trainer", 12)
    assert function_of_consumer("sampler") == ("sampler", None)


def test_function_info_metric():
    metrics.set_function_info("test-fn", {"device": "cuda", "dtype": "bfloat16", "backend": None,
                                          "bad-name": "x", "function": "spoof"})
    text = metrics.exposition()[0].decode()
    (line,) = [x for x in text.splitlines() if x.startswith("openrl_function_info{") and 'function="test-fn"' in x]
    assert 'device="cuda"' in line and 'dtype="bfloat16"' in line and 'backend=""' in line
    assert "bad" not in line and "spoof" not in line and line.endswith(" 1.0")


def _records(nats_url: str) -> list[dict]:
    async def read():
        bus = await Bus(nats_url).connect()
        try:
            return await bus.meta_list(WORKERS_KEY)
        finally:
            await bus.close()

    return asyncio.run(read())


def _wait_for(what: str, check, timeout_s: float = 60.0, procs=()):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        for p in procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_jetstream_worker_describes_itself(tmp_path, nats_url, monkeypatch):
    """Two real worker processes (a fake trainer on shard 1, a fake sampler) write their
    records; the trainer's backend turns from pending to torch after its fake model load;
    /api/v1/status and the table show device, dtype and backend per worker; a clean stop
    deletes the record (status then answers None for that consumer)."""
    pkg = tmp_path / "fakefns"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "trainer.py").write_text(FAKE_FUNCTION)
    (pkg / "sampler.py").write_text(FAKE_FUNCTION)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
           "OPENRL_WORKER_REFRESH_S": "0.3", "OPENRL_LOG_FORMAT": "text"}
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = {
        "trainer": subprocess.Popen(
            [sys.executable, "-m", "openrl.transport.worker", "fakefns.trainer", "--nats", nats_url, "--shard", "1",
             "--drain-s", "1"], env={**env, "FAKE_BACKEND": "torch", "FAKE_LOAD_S": "1.5"}, cwd=ROOT,
            stdout=open(logs / "trainer.log", "wb"), stderr=subprocess.STDOUT),
        "sampler": subprocess.Popen(
            [sys.executable, "-m", "openrl.transport.worker", "fakefns.sampler", "--nats", nats_url, "--drain-s", "1"],
            env={**env, "FAKE_BACKEND": "vllm"}, cwd=ROOT,
            stdout=open(logs / "sampler.log", "wb"), stderr=subprocess.STDOUT),
    }
    try:
        def by_function():
            return {r["function"]: r for r in _records(nats_url)}

        recs = _wait_for("both worker records", lambda: (r := by_function()) and len(r) == 2 and r,
                         procs=procs.values())
        tr, sa = recs["trainer"], recs["sampler"]
        assert (tr["shard"], tr["pid"], tr["device"]) == (1, procs["trainer"].pid, "cpu")
        assert (sa["shard"], sa["pid"], sa["device"], sa["dtype"], sa["backend"]) == (
            None, procs["sampler"].pid, "cpu", "float32", "vllm")
        for r in (tr, sa):
            assert r["host"] and r["started"].endswith("Z") and r["instance"] == f"{r['host']}:{r['pid']}"
        # refreshed: the backend follows the (fake) first model load
        tr = _wait_for("the trainer's backend after its model load",
                       lambda: (r := by_function().get("trainer")) and r["backend"] == "torch" and r,
                       procs=procs.values())
        assert tr["dtype"] == "float32" and tr["started"] == recs["trainer"]["started"]

        # GET /api/v1/status of a real gateway app on the same NATS
        from fastapi.testclient import TestClient

        from functions.gateway.app import create_app
        from openrl.cli import status as cli_status
        from openrl.edge.auth import KeyRing
        from openrl.model.registry import ModelRegistry

        app = create_app(nats_url=nats_url, storage_url=(tmp_path / "storage").as_uri(),
                         registry=ModelRegistry.load(None, models_dir=tmp_path / "models"),
                         keys=KeyRing([], allow_any=True))
        headers = {"X-API-Key": "tml-status-test"}
        with TestClient(app, headers=headers) as http:
            def status_workers():
                r = http.get("/api/v1/status")
                assert r.status_code == 200, r.text
                return {w["consumer"]: w for w in r.json()["workers"]}

            workers = _wait_for("both consumers", lambda: (w := status_workers()) and
                                {"trainer-1", "sampler"} <= set(w) and w)
            t, s = workers["trainer-1"], workers["sampler"]
            assert (t["function"], t["shard"], t["device"], t["dtype"], t["backend"]) == (
                "trainer", 1, "cpu", "float32", "torch")
            assert (s["function"], s["shard"], s["device"], s["dtype"], s["backend"]) == (
                "sampler", None, "cpu", "float32", "vllm")
            for w in (t, s):  # the existing fields are all still there
                assert {"stream", "state", "num_pending", "num_ack_pending", "num_waiting", "num_redelivered",
                        "last_active", "idle_s"} <= set(w), w

            # the openrl status table, from the same answers
            client = cli_status.Client("http://gateway.test", "tml-status-test")
            client.http = http
            monkeypatch.setattr(cli_status, "_client", lambda args: client)
            monkeypatch.setenv("COLUMNS", "250")
            from io import StringIO

            from rich.console import Console

            buf = StringIO()
            monkeypatch.setattr(cli_status, "_console", lambda: Console(file=buf, width=250, emoji=False,
                                                                          highlight=False))
            args = argparse.Namespace(json=False, limit=5, state_dir=tmp_path)  # no supervisor.json there
            assert cli_status.cmd_status(args) == 0
            table = buf.getvalue()
            for word in ("device", "dtype", "backend", "float32", "torch", "vllm"):
                assert word in table, table
            (row,) = [line for line in table.splitlines() if "trainer" in line and "torch" in line]
            assert "cpu" in row and "float32" in row

            # a clean stop deletes the trainer's record; status then knows nothing of it
            procs["trainer"].send_signal(signal.SIGTERM)
            assert procs["trainer"].wait(timeout=60) == 0
            assert set(by_function()) == {"sampler"}
            t = status_workers()["trainer-1"]
            assert (t["device"], t["dtype"], t["backend"]) == (None, None, None)
            assert status_workers()["sampler"]["backend"] == "vllm"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    assert _records(nats_url) == []


async def test_stale_records_are_ignored_then_deleted(nats_url):
    """A record its worker stopped refreshing (killed) does not show, and the next worker
    to start deletes it; a record with no describe() has None fields."""
    bus = await Bus(nats_url).connect()
    try:
        dead = {"function": "trainer", "shard": 0, "instance": "gone:1", "pid": 1, "host": "gone",
                "device": "cuda", "dtype": "bfloat16", "backend": "torch", "started": "2020-01-01T00:00:00Z",
                "updated": "2020-01-01T00:00:00Z", "updated_unix": time.time() - 600, "refresh_s": 30.0}
        await bus.meta_put(dead, WORKERS_KEY, "trainer", "0", "gone:1")
        assert await worker_records(bus) == {}
        p = WorkerPresence(bus, NoDescribe(), function="trainer", shard=0, refresh_s=0.1)
        await p.start()
        try:
            recs = await worker_records(bus)
            assert set(recs) == {("trainer", 0)}
            assert (recs[("trainer", 0)]["device"], recs[("trainer", 0)]["backend"]) == (None, None)
            assert [r["instance"] for r in await bus.meta_list(WORKERS_KEY)] == [p.instance]  # the stale one is gone
            first = recs[("trainer", 0)]["updated_unix"]
            await asyncio.sleep(0.35)
            assert (await worker_records(bus))[("trainer", 0)]["updated_unix"] > first
        finally:
            await p.stop()
        assert await bus.meta_list(WORKERS_KEY) == []
    finally:
        await bus.close()



def test_http_binding_exports_function_info():
    """The HTTP binding (Knative) sets openrl_function_info after start() and refreshes it
    at each scrape, so the backend shows up once the first model has loaded."""
    from fastapi.testclient import TestClient

    from openrl.transport.bindings.http import create_app

    class Fake:
        backend = "pending"

        async def start(self, cfg):
            pass

        async def stop(self):
            pass

        def alive(self):
            return True

        def ready(self):
            return True

        def describe(self):
            return {"device": "cpu", "dtype": "float32", "backend": self.backend}

    fn = Fake()

    def info_line(text):
        (line,) = [x for x in text.splitlines() if x.startswith("openrl_function_info{") and 'function="httpfake"' in x]
        return line

    with TestClient(create_app(fn, source="/openrl/httpfake")) as http:
        assert 'backend="pending"' in info_line(metrics.exposition()[0].decode())
        fn.backend = "vllm"
        line = info_line(http.get("/metrics").text)
        assert 'backend="vllm"' in line and 'device="cpu"' in line and 'dtype="float32"' in line
