"""bench/profile_site/sitecustomize.py's stack sampler (``OPENRL_BENCH_STACKS``) and
bench/stack_samples.py, which turns its files into a timeline: a real Python process samples its
own threads; the analyzer names the busy thread when the main thread only waits, and a sample
survives a SIGKILL (each one is flushed). Offline; nothing here needs a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import stack_samples  # noqa: E402

CHILD = """
import threading, time
def crunch(until):
    x = 0
    while time.time() < until:
        x += 1
t = threading.Thread(target=crunch, args=(time.time() + 1.2,), name="cruncher")
t.start()
t.join()                       # the main thread only waits while the worker thread computes
deadline = time.time() + 0.8
while time.time() < deadline:  # then the main thread computes
    pass
print("ready", flush=True)
time.sleep(60)
"""


def test_a_process_samples_its_threads_and_the_analyzer_names_the_busy_one(tmp_path):
    out = tmp_path / "stacks"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "bench" / "profile_site"), "OPENRL_BENCH_STACKS": str(out),
           "OPENRL_BENCH_STACKS_EVERY": "0.05"}
    env.pop("OPENRL_BENCH_PROFILE", None)
    p = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.2)
    finally:
        p.kill()  # SIGKILL: what was sampled must already be on disk
        p.wait()
    (f,) = out.glob(f"stacks_{p.pid}.txt")
    head, samples = stack_samples.parse(f)
    assert head["pid"] == p.pid and head["every"] == 0.05 and samples
    segs, per = stack_samples.timeline(head, samples, min_s=0.2)
    labels = [s["label"] for s in segs]
    worker = [x for x in labels if x.startswith("[cruncher] ") and x.endswith(":crunch")]
    main = [x for x in labels if not x.startswith("[") and x.endswith(":<module>")]
    assert worker and main, labels
    assert labels.index(worker[0]) < labels.index(main[0])  # in the order they happened
    assert per[worker[0]] > 0.3 and per[main[0]] > 0.2  # seconds, of 1.2 and 0.8 s (margin for a loaded host)
