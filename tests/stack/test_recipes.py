"""The recipes run, unmodified, against the embedded stack: both notebooks executed top to
bottom with nbclient (a real Jupyter kernel), and the text-to-SQL RL script for 2 steps and
then resumed for a third.

Step counts, batch sizes and token budgets are shrunk through the notebooks' environment
variables and the script's flags; the built model is random, so these tests check the
mechanics (cells run, plot drawn, CSV rows, checkpoints, resume), not learning.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
RL_SCRIPT = ROOT / "examples" / "text_to_sql_rl.py"

TINY_NOTEBOOK_ENV = {
    "OPENRL_NB_STEPS": "2",
    "OPENRL_NB_BATCH": "2",
    "OPENRL_NB_SHOW": "2",
    "OPENRL_NB_EVAL": "2",
    "OPENRL_NB_MAX_TOKENS": "8",
}


@pytest.fixture
def client_env(stack, api_key, tmp_path, monkeypatch) -> dict[str, str]:
    """The environment a user's kernel / script would have against the stack."""
    env = {"TINKER_BASE_URL": stack.base_url, "TINKER_API_KEY": api_key, "TINKER_TELEMETRY": "0",
           "OPENRL_NB_DB": str(tmp_path / "shop.db"), "MPLBACKEND": "Agg", **TINY_NOTEBOOK_ENV}
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # the kernel inherits this process's environment
    return env


def run_notebook(name: str, out_dir: Path):
    pytest.importorskip("nbclient")  # (none of these is in the GPU conformance run's image)
    pytest.importorskip("matplotlib")
    import nbformat
    from nbclient import NotebookClient

    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    try:
        client.execute()  # raises CellExecutionError on the first failing cell
    finally:
        nbformat.write(nb, out_dir / name)  # the executed copy, for a failure's post-mortem
    return nb


def outputs(nb) -> tuple[str, list[str]]:
    """(all stream text, the MIME types of all rich outputs)."""
    text, mimes = [], []
    for cell in nb.cells:
        for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
            assert o.output_type != "error", o
            if o.output_type == "stream":
                text.append(o.text)
            else:
                mimes += list(o.get("data", {}))
    return "".join(text), mimes


def test_notebooks_have_one_parameters_cell_first():
    nbformat = pytest.importorskip("nbformat")

    for name in ("pig_latin_sft.ipynb", "text_to_sql_sft.ipynb"):
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert "parameters" in code[0].metadata.get("tags", []), name
        src = code[0].source
        for var in ("TINKER_BASE_URL", "OPENRL_NB_STEPS", "MODEL"):
            assert var in src, (name, var)
        assert not any(c.get("outputs") for c in code), f"{name} is committed with outputs"
        all_src = "\n".join(c.source for c in code)
        assert "import tinker" in all_src and "apply_chat_template" in all_src
        assert "import openrl" not in all_src and "from openrl" not in all_src  # public SDK only
        assert "from functions" not in all_src


def test_pig_latin_notebook(client_env, tmp_path):
    nb = run_notebook("pig_latin_sft.ipynb", tmp_path)
    text, mimes = outputs(nb)
    assert "loss per token:" in text
    assert "sampler_weights/" in text  # save_weights_for_sampler gave a sampler path
    assert "exact match: before" in text
    assert "image/png" in mimes  # the loss curve, inline


def test_text_to_sql_notebook(client_env, tmp_path):
    nb = run_notebook("text_to_sql_sft.ipynb", tmp_path)
    text, mimes = outputs(nb)
    assert "loss per token:" in text
    assert "sampler_weights/" in text
    assert "execution accuracy: before" in text and "valid SQL:" in text
    assert "image/png" in mimes
    assert Path(client_env["OPENRL_NB_DB"]).exists()


def run_rl(env: dict, out: Path, steps: int, *extra: str) -> str:
    cmd = [sys.executable, str(RL_SCRIPT), "--steps", str(steps), "--out-dir", str(out), "--questions", "1",
           "--group", "2", "--max-tokens", "6", "--eval-size", "1", *extra]
    p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p.stdout + p.stderr


def read_rows(out: Path) -> list[dict]:
    with (out / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_text_to_sql_rl_runs_and_resumes(client_env, tmp_path):
    out = tmp_path / "rl"
    log = run_rl(client_env, out, 2, "--save-every", "1")
    assert "mean_reward=" in log and "eval_exec_acc=" in log
    rows = read_rows(out)
    assert [r["step"] for r in rows] == ["0", "1"]
    for r in rows:
        assert 0.0 <= float(r["mean_reward"]) <= 1.0
        assert 0.0 <= float(r["valid_sql_frac"]) <= 1.0
        assert 0.0 <= float(r["eval_exec_acc"]) <= 1.0
        assert int(r["n_samples"]) == 2 and int(r["n_datums"]) > 0 and r["loss_sum"] != ""
        assert r["checkpoint"].startswith("tinker://")
    state = json.loads((out / "state.json").read_text())
    assert state["step"] == 2 and state["state_path"] == rows[-1]["checkpoint"]

    # An interruption after step 2's metrics were written but before its state was saved:
    # the stale row is dropped and the step redone from the last saved state.
    with (out / "metrics.csv").open("a", newline="") as f:
        f.write("2,0.5,0.5,,,,0,0,0,\n")
    log = run_rl(client_env, out, 3)
    assert "resuming from step 2" in log
    rows = read_rows(out)
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert rows[2]["checkpoint"].startswith("tinker://") and rows[2]["n_samples"] == "2"
    state = json.loads((out / "state.json").read_text())
    assert state["step"] == 3 and state["state_path"] == rows[2]["checkpoint"]

    # Nothing left to do: a rerun resumes at 3 and runs no step.
    log = run_rl(client_env, out, 3)
    assert "resuming from step 3" in log and len(read_rows(out)) == 3
