"""``openrl status`` / ``openrl runs list`` / ``openrl checkpoints list`` against the real
stack's REST routes (in-process CLI, real gateway)."""

from __future__ import annotations

import json

import pytest
import tinker

from conftest import BASE_MODEL
from openrl import cli


@pytest.fixture(scope="module")
def run_with_checkpoint(stack, api_key):
    service = tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=7).result()
    path = tc.save_state("cli-ckpt").result().path
    return tc.model_id, path


def openrl(capsys, stack, key, *argv) -> tuple[int, str, str]:
    rc = cli.main([*argv, "--base-url", stack.base_url, "--api-key", key, "--state-dir", str(stack.state_dir)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_status_json(capsys, stack, api_key, run_with_checkpoint):
    run_id, _ = run_with_checkpoint
    rc, out, _ = openrl(capsys, stack, api_key, "status", "--json", "--limit", "1000")
    assert rc == 0
    st = json.loads(out)
    workers = {w["consumer"]: w for w in st["workers"]}
    assert {"trainer-0", "sampler"} <= set(workers)
    assert workers["trainer-0"]["function"] == "trainer" and workers["trainer-0"]["shard"] == 0
    # the trainer has taken the fixture's requests; no queue waits without a worker pulling
    assert workers["trainer-0"]["last_active"] is not None and workers["trainer-0"]["idle_s"] >= 0
    for w in workers.values():
        assert w["state"] in ("polling", "busy", "idle"), w
        # what the worker runs on, from its record in the meta bucket (openrl/worker.py)
        assert {"device", "dtype", "backend"} <= set(w), w
    from functions.trainer.function import TrainerFunction

    if hasattr(TrainerFunction, "describe"):  # the functions run on this machine's GPU when it has one
        import torch

        want = "cuda" if torch.cuda.is_available() else "cpu"
        assert str(workers["trainer-0"]["device"]).startswith(want), workers["trainer-0"]
    assert {q["stream"] for q in st["queues"]} == {"OPENRL_TRAIN", "OPENRL_SAMPLE"}
    assert run_id in [r["training_run_id"] for r in st["training_runs"]["training_runs"]]
    assert st["training_runs"]["cursor"]["total_count"] >= 1 and len(st["sessions"]["sessions"]) >= 1


def test_status_tables(capsys, monkeypatch, stack, api_key, run_with_checkpoint):
    monkeypatch.setenv("COLUMNS", "200")
    rc, out, _ = openrl(capsys, stack, api_key, "status")
    assert rc == 0
    for text in ("Workers", "trainer", "sampler", "device", "dtype", "backend", "Queues", "OPENRL_TRAIN",
                 "OPENRL_SAMPLE", "Training runs"):
        assert text in out, text


def test_runs_and_checkpoints_list(capsys, monkeypatch, stack, api_key, run_with_checkpoint):
    monkeypatch.setenv("COLUMNS", "200")
    run_id, path = run_with_checkpoint
    rc, out, _ = openrl(capsys, stack, api_key, "runs", "list", "--limit", "100")
    assert rc == 0 and run_id in out  # ids are never cut or turned into emoji (":train:")
    rc, out, _ = openrl(capsys, stack, api_key, "runs", "list", "--limit", "100", "--json")
    runs = {r["training_run_id"]: r for r in json.loads(out)["training_runs"]}
    assert runs[run_id]["last_checkpoint"]["tinker_path"] == path

    rc, out, _ = openrl(capsys, stack, api_key, "checkpoints", "list", run_id)
    assert rc == 0 and "weights/cli-ckpt" in out and "training" in out
    rc, out, _ = openrl(capsys, stack, api_key, "checkpoints", "list", run_id, "--json")
    assert [c["tinker_path"] for c in json.loads(out)["checkpoints"]] == [path]


def test_errors_are_one_line_and_exit_1(capsys, stack, api_key):
    rc, out, err = openrl(capsys, stack, "tml-wrong-key", "status")
    assert rc == 1 and "HTTP 401" in err and "--api-key" in err and out == ""
    rc, _, err = openrl(capsys, stack, api_key, "checkpoints", "list", "nope:train:0")
    assert rc == 1 and "HTTP 404" in err
    rc = cli.main(["status", "--base-url", "http://127.0.0.1:9", "--api-key", api_key])
    assert rc == 1 and "cannot reach the gateway" in capsys.readouterr().err
