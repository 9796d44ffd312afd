"""examples/sweep.py: 3 RL runs x 3 steps in parallel against the real stack (then the same
runs one after another), writing the results CSV, the PNG plot and the timing summary."""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")  # the example draws its plot (not in the GPU conformance run's image)

ROOT = Path(__file__).resolve().parents[2]


def test_sweep_example_writes_csv_plot_and_speedup(stack, api_key, tmp_path):
    out = tmp_path / "sweep"
    env = {**os.environ, "TINKER_BASE_URL": stack.base_url, "TINKER_API_KEY": api_key, "TINKER_TELEMETRY": "0",
           "COLUMNS": "120"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sweep.py"), "--runs", "3", "--steps", "3", "--warmup-steps", "0",
         "--problems", "2", "--group", "2", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    rows = list(csv.DictReader((out / "sweep.csv").open()))
    for phase in ("parallel", "sequential"):
        mine = [r for r in rows if r["phase"] == phase]
        runs = {r["run"] for r in mine}
        assert len(runs) == 3, (phase, runs)
        for run in runs:
            assert sorted(int(r["step"]) for r in mine if r["run"] == run) == [0, 1, 2]
    for r in rows:
        assert 0.0 <= float(r["mean_reward"]) <= 1.0 and float(r["step_seconds"]) > 0

    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1100, 400) and len(png) > 20_000

    summary = json.loads((out / "sweep.json").read_text())
    assert summary["runs"] == 3 and summary["sequential_source"] == "measured"
    assert sorted({float(r["lr"]) for r in rows}) == sorted(summary["learning_rates"])
    # speedup is computed from the unrounded walls, so compare it with the rounded walls' ratio to 3 decimals.
    assert summary["speedup"] == pytest.approx(summary["sequential_wall_s"] / summary["parallel_wall_s"], abs=2e-3)
    assert f"{summary['speedup']}x faster" in proc.stdout.replace("\n", " ")
