"""examples/autoresearch: the autoresearch driver against the session stack (real tinker SDK,
real gateway, trainer and sampler), on the tiny built model at tiny sizes.

* optuna proposer, 10 experiments x 4 steps, 2 at a time, no pruner: the run is interrupted with SIGINT
  (Ctrl-C) once the first experiment has ended, then the same command resumes it: the
  finished experiments are not redone, the interrupted ones run again as new experiments, and
  the leaderboard ends with 10 finished experiments with finite rewards, a table and a PNG plot;
* optuna pruning: a threshold no reward can reach prunes every trial after its first step;
* the external-command proposer: a tiny Python script reads the leaderboard and prints the next
  config (a text-to-SQL experiment with ppo on the generated shop database, an arithmetic one with
  stable_reinforce, then an invalid config that fails with the field's name, then ``null``,
  which ends the sweep).

Nothing is mocked. The interruption waits for a leaderboard line, not for a time.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BASE_MODEL

pytest.importorskip("matplotlib")  # the leaderboard's plot (not in the GPU conformance run's image)

ROOT = Path(__file__).resolve().parents[2]
SPACE = {"learning_rate": {"low": 1e-3, "high": 3e-2, "log": True}, "rank": [4], "group_size": [2],
         "loss": ["importance_sampling", "ppo", "stable_reinforce"],
         "reward": ["arithmetic/exact", "arithmetic/shaped", "arithmetic/distance"]}


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "examples" / "autoresearch"), "--model", BASE_MODEL, "--out", str(out),
            "--prompts", "1", "--max-tokens", "4", *extra]


def _env(stack, api_key) -> dict:
    return {**os.environ, "TINKER_BASE_URL": stack.base_url, "TINKER_API_KEY": api_key, "TINKER_TELEMETRY": "0",
            "COLUMNS": "160"}


def _records(out: Path) -> list[dict]:
    p = out / "leaderboard.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def _experiments(out: Path) -> dict[str, dict]:
    """id -> {"start": record, "steps": [records], "end": record or None}."""
    exps: dict[str, dict] = {}
    for r in _records(out):
        if r["event"] == "start":
            assert r["id"] not in exps, f"{r['id']} started twice"
            exps[r["id"]] = {"start": r, "steps": [], "end": None}
        elif r["event"] == "step":
            exps[r["id"]]["steps"].append(r)
        else:
            assert exps[r["id"]]["end"] is None, f"{r['id']} ended twice"
            exps[r["id"]]["end"] = r
    return exps


def _run(cmd, env, timeout=300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def test_optuna_sweep_interrupted_and_resumed(stack, api_key, tmp_path):
    pytest.importorskip("optuna")
    out = tmp_path / "ar"
    (tmp_path / "space.json").write_text(json.dumps(SPACE))
    # 10 experiments of 4 steps, 2 at a time, no pruning: after the first one ends, four more
    # rounds of 4 steps remain (5-10 s here), so the Ctrl-C below lands mid-sweep however late the
    # poll sees the end record.
    n_exp, n_steps = 10, 4
    cmd = _cmd(out, "--experiments", str(n_exp), "--parallel", "2", "--steps", str(n_steps),
               "--pruner", "none", "--space", str(tmp_path / "space.json"))
    env = _env(stack, api_key)

    # Ctrl-C as in a terminal: the child gets SIGINT's default disposition, whatever this process
    # inherited (a shell's background job, e.g. `nohup bash .ci/run &`, ignores SIGINT, and an
    # ignored signal stays ignored across exec: the driver then never saw the Ctrl-C and the
    # whole sweep ran to its end, 2026-12-02)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300  # a guard against a hang, not a timing assertion
        while not any(r["event"] == "end" for r in _records(out)):
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "no experiment ended"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        first_out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, first_out[-4000:]
    before = _experiments(out)
    done_before = {i for i, e in before.items() if e["end"]["status"] in ("completed", "pruned")}
    interrupted = {i for i, e in before.items() if e["end"]["status"] == "interrupted"}
    assert done_before and done_before | interrupted == set(before), before  # every experiment got an end record
    assert all(len(before[i]["steps"]) < n_steps for i in interrupted)

    second = _run(cmd, env)
    assert "resuming" in second.stdout
    exps = _experiments(out)
    for i in done_before:  # finished experiments are neither redone nor touched
        assert exps[i] == before[i]
    reruns = {e["start"]["rerun_of"]: i for i, e in exps.items() if e["start"]["rerun_of"]}
    assert set(reruns) == interrupted
    for old, new in reruns.items():
        assert exps[new]["start"]["config"] == exps[old]["start"]["config"]
    # the resumed study proposes new configs, not the first run's again
    fresh = [e["start"]["config"] for i, e in exps.items() if i not in before and not e["start"]["rerun_of"]]
    assert all(c not in [e["start"]["config"] for e in before.values()] for c in fresh)
    finished = {i: e for i, e in exps.items() if e["end"]["status"] in ("completed", "pruned")}
    assert len(finished) == n_exp and len(exps) == n_exp + len(interrupted)
    for e in finished.values():
        cfg = e["start"]["config"]
        assert cfg["rank"] == 4 and cfg["group_size"] == 2 and cfg["loss"] in SPACE["loss"]
        assert 1e-3 <= cfg["learning_rate"] <= 3e-2
        rewards = [s["reward"] for s in e["steps"]]
        assert [s["step"] for s in e["steps"]] == list(range(len(rewards))) and 1 <= len(rewards) <= n_steps
        assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in rewards)
        if e["end"]["status"] == "completed":
            assert len(rewards) == n_steps and e["end"]["objective"] == rewards[-1]

    import optuna

    study = optuna.load_study(study_name="autoresearch", storage=f"sqlite:///{out / 'optuna.db'}")
    states = [t.state.name for t in study.trials]
    # one trial per experiment, plus at most one asked for while the Ctrl-C came (never started:
    # FAIL, like the interrupted experiments' trials); nothing left RUNNING or WAITING
    assert len(exps) <= len(states) <= len(exps) + 1
    assert states.count("COMPLETE") + states.count("PRUNED") == n_exp
    assert states.count("FAIL") == len(states) - n_exp >= len(interrupted)

    png = (out / "rewards.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    table = (out / "leaderboard.txt").read_text()
    assert all(i in table for i in exps)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiments"] == len(exps) and summary["by_status"].get("interrupted", 0) == len(interrupted)


def test_optuna_prunes_below_threshold(stack, api_key, tmp_path):
    pytest.importorskip("optuna")
    out = tmp_path / "ar"
    (tmp_path / "space.json").write_text(json.dumps({**SPACE, "loss": ["importance_sampling"]}))
    _run(_cmd(out, "--experiments", "2", "--parallel", "2", "--steps", "2", "--space", str(tmp_path / "space.json"),
              "--pruner", "threshold:1.5"), _env(stack, api_key))
    exps = _experiments(out)
    assert len(exps) == 2
    for e in exps.values():  # reward <= 1 < 1.5: pruned after the first step, never ran step 1
        assert e["end"]["status"] == "pruned" and len(e["steps"]) == 1 and e["end"]["steps"] == 1

    import optuna

    study = optuna.load_study(study_name="autoresearch", storage=f"sqlite:///{out / 'optuna.db'}")
    assert [t.state.name for t in study.trials] == ["PRUNED", "PRUNED"]


AGENT = '''
import json, os
records = [json.loads(x) for x in open(os.environ["AUTORESEARCH_LEADERBOARD"])] \\
    if os.path.exists(os.environ["AUTORESEARCH_LEADERBOARD"]) else []
started = [r for r in records if r["event"] == "start"]
space = json.loads(os.environ["AUTORESEARCH_SPACE"])
if not started:
    print("thinking...")  # only the last line counts
    print(json.dumps({"learning_rate": 0.02, "rank": 4, "group_size": 2, "loss": "ppo",
                      "reward": "text_to_sql/exec_partial", "max_tokens": 6, "seed": 7}))
elif len(started) == 1:  # stable_reinforce: the datums carry provenance spans of the recorded samples
    print(json.dumps({"learning_rate": 0.01, "rank": 4, "group_size": 2, "loss": "stable_reinforce",
                      "reward": space["reward"][0]}))
elif len(started) == 2:
    print(json.dumps({"rank": 0, "reward": space["reward"][0]}))  # invalid: rank >= 1
else:
    print("null")
'''


def test_command_proposer(stack, api_key, tmp_path):
    out = tmp_path / "ar"
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    (tmp_path / "space.json").write_text(json.dumps(SPACE))
    proc = _run(_cmd(out, "--experiments", "5", "--parallel", "1", "--steps", "2", "--space",
                     str(tmp_path / "space.json"), "--proposer-command", f"{sys.executable} {agent}"),
                _env(stack, api_key))
    exps = list(_experiments(out).values())
    assert len(exps) == 3, proc.stdout[-3000:]  # then the agent printed null: the sweep ended under budget
    sql, sr, bad = exps
    assert sql["start"]["proposer"] == "command" and sql["end"]["status"] == "completed"
    cfg = sql["start"]["config"]
    assert (cfg["reward"], cfg["loss"], cfg["learning_rate"], cfg["seed"]) == ("text_to_sql/exec_partial", "ppo", 0.02, 7)
    assert len(sql["steps"]) == 2 and all(math.isfinite(s["reward"]) for s in sql["steps"])
    assert (out / "shop.db").exists()  # the text-to-SQL reward ran the sampled SQL on the generated database
    assert sr["start"]["config"]["loss"] == "stable_reinforce" and sr["end"]["status"] == "completed", sr["end"]
    assert len(sr["steps"]) == 2 and all(math.isfinite(s["reward"]) for s in sr["steps"])
    assert bad["end"]["status"] == "failed" and "config.rank" in bad["end"]["error"] and not bad["steps"]
    assert (out / "rewards.png").exists()
