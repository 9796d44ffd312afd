"""bench/device_call.sh, the one runner of bench/'s device calls: it parses, ``--list`` names every step with
its carry, and ``--carry`` answers the device tool's list. (Checked offline; nothing here needs a GPU.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "bench" / "device_call.sh"
STEPS = {
    "cobatch-peft": [".whl/c1", ".vllm-h200"],
    "sampler-hf-vllm": [".whl/c2", ".vllm-h200"],
    "stack-cold": [".gpu", ".whl/s1"],
    "stack-sft": [".gpu", ".whl/s1"],
    "stack-keep-vllm": [".whl/s2"],
    "stack-sample-rl": [".whl/s3"],
    "stack-sweep": [".whl/s4"],
    "conform-A": [".gpu", ".whl/k1"],
    "conform-B": [".whl/k2"],
    "conform-C": [".whl/k3"],
    "conform-D": [],
    "conform-R": [".gpu"],
    "stack-after-conform": [],
    "stack-fresh": [".gpu"],
    "stack-lora-probe": [],
    "stack-export-probe": [".gpu"],
    "engine-rl-probe": [".gpu"],
    "engine-sleep-probe": [".gpu"],
    "engine-probes": [".gpu"],
    "determinism": [".gpu"],
}

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")


def _bash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=30, cwd=ROOT)


def test_the_runner_parses():
    proc = _bash("-n", str(RUNNER))
    assert proc.returncode == 0, proc.stderr


def test_list_names_every_step_with_its_carry():
    proc = _bash(str(RUNNER), "--list")
    assert proc.returncode == 0, proc.stderr
    listed = dict(re.findall(r"^(\S+)\s+carry: (\[.*\])$", proc.stdout, re.M))
    assert {k: json.loads(v) for k, v in listed.items()} == STEPS


@pytest.mark.parametrize("step", sorted(STEPS))
def test_carry_answers_the_device_tool_list(step):
    proc = _bash(str(RUNNER), "--carry", step)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == STEPS[step]


def test_an_unknown_step_fails_before_doing_anything():
    proc = _bash(str(RUNNER), "no-such-step")
    assert proc.returncode == 2 and "unknown step" in proc.stderr


def test_the_replaced_scripts_are_gone():
    old = ["gpu_call1", "gpu_call2", "stack_call1", "stack_call3", "stack_call4", "stack_callA", "stack_callB",
           "conform_call"]
    assert [n for n in old if (ROOT / "bench" / f"{n}.sh").exists()] == []
