"""A worker process with the usage flusher running exits at once and writes its last totals: a
real nats-server and a real Python process that accounts usage and returns from main (found by a
new user: every worker's exit waited out the flush interval, then printed "cannot schedule new
futures after shutdown" and skipped the final flush)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

from nats_helpers import nats_url  # noqa: F401
from openrl.observe.usage import USAGE_PREFIX
from openrl.transport.bus import Bus

CHILD = textwrap.dedent("""
    import time
    from openrl.observe.usage import LEDGER
    LEDGER.add("owner-x", function="sampler", tokens_sampled=7)
    time.sleep(0.5)  # the flusher is waiting out its interval now
    print("exiting", flush=True)
""")


def test_worker_exit_is_prompt_and_flushes(nats_url, tmp_path):  # noqa: F811
    env = {**os.environ, "OPENRL_NATS_URL": nats_url, "OPENRL_USAGE_FLUSH_S": "60", "OPENRL_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "cannot schedule new futures" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

    async def records():
        bus = await Bus(nats_url).connect()
        try:
            return await bus.meta_list(USAGE_PREFIX)
        finally:
            await bus.close()

    recs = asyncio.run(records())
    assert [r["tokens_sampled"] for r in recs if r.get("owner") == "owner-x"] == [7]
