"""``--model NAME=DIR``'s config check runs beside the stack's start (openrl/cli/model_check.py).

The real ``openrl`` command line runs as a process (``python -m openrl.cli``) with the session's
built tiny model and real nats-server, worker and gateway processes on CPU; nothing is mocked.

- a config that transformers cannot use as a causal LM still stops ``openrl serve`` with the one
  line that names it, no process of the stack is left, and the overlay's entry for that name is
  the one it had before the command (nothing stored is lost);
- a config not checked before is checked while the workers start: ``openrl run`` announces the
  entry, the script reaches the stack, and the config is remembered, so the next start runs no
  check process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from openrl.model.registry import CHECKED_CONFIGS, overlay_path
from openrl.transport import pidfile


def openrl(*argv, home: Path, timeout: float = 240) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "openrl.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OPENRL_HOME": str(home),
                                                "TINKER_BASE_URL": "", "TINKER_API_KEY": ""})
    return proc.returncode, proc.stdout, proc.stderr


def test_a_config_that_fails_stops_the_start_and_keeps_the_old_entry(tmp_path):
    bad = tmp_path / "t5"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
                                                 "is_encoder_decoder": True}))
    (bad / "model.safetensors").write_bytes(b"")  # the quick checks look at file names only
    (bad / "tokenizer.json").write_text("{}")
    state = tmp_path / "st"
    (state / "models").mkdir(parents=True)
    overlay_path(state / "models").write_text('[models."Qwen/x"]\npath = "/elsewhere/qwen"\ndtype = "bfloat16"\n')
    rc, _, err = openrl("serve", "--state-dir", state, "--no-build", "--port", 0, "--idle-timeout", 0,
                        "--model", f"Qwen/x={bad}", home=tmp_path)
    assert rc == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"openrl serve: error: --model Qwen/x={bad}: ")
    assert "model_type 't5' is not a causal LM" in lines[0] and "give the directory of a Hugging Face causal LM" in lines[0]
    data = tomllib.loads(overlay_path(state / "models").read_text())
    assert data["models"] == {"Qwen/x": {"path": "/elsewhere/qwen", "dtype": "bfloat16"}}
    assert not pidfile.alive(state)
    assert not (state / "models" / CHECKED_CONFIGS).exists() or str(bad) not in (state / "models" / CHECKED_CONFIGS).read_text()


def test_a_config_is_checked_while_the_stack_starts_and_then_remembered(tmp_path, models_dir):
    good = tmp_path / "tiny"
    shutil.copytree(models_dir / "tiny-qwen3", good)
    script = tmp_path / "probe.py"
    script.write_text("import os, urllib.request\n"
                      "urllib.request.urlopen(os.environ['TINKER_BASE_URL'] + '/api/v1/healthz', timeout=10)\n"
                      "print('reached', flush=True)\n")
    state = tmp_path / "st"
    checked = state / "models" / CHECKED_CONFIGS
    for first in (True, False):
        rc, out, err = openrl("run", "--state-dir", state, "--no-build", "--idle-timeout", 0, "--port", 0,
                              "--model", f"org/tiny={good}", script, home=tmp_path)
        assert rc == 0, err
        assert "reached" in out
        assert f"org/tiny: {good}" in err and "registered in" in err  # announced once its config passed
        remembered = json.loads(checked.read_text())
        assert [k for k in remembered if k.startswith(f"{good.resolve()}|")], remembered
        startup = json.loads((state / "ports.json").read_text())["startup"]
        assert startup["serve_to_workers"] >= 0
    assert not pidfile.alive(state)
