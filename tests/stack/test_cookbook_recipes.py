"""More tinker-cookbook 0.6.1 recipes, unmodified, against the embedded stack, 2 steps each
(issue 13 item 6; ``sl_basic`` and ``rl_basic`` are in ``test_cookbook.py``):

* ``recipes.rl_loop`` with its default ``loss_fn=stable_reinforce`` (record_stability_info
  sampling, provenance spans on every datum);
* ``recipes.math_rl.train`` with its default ``env=arithmetic`` and ``loss_fn=stable_reinforce``
  (the cookbook's ``rl.train`` loop);
* ``recipes.preference.dpo.train`` with its default ``dataset=hhh`` (DPO through
  ``forward_backward_custom`` against a reference sampling client);
* ``recipes.decisions.forecasting`` (Brier loss through ``forward_backward_custom`` with (T, K)
  targets, evaluation by ``target_prompt_logprobs``).

Each runs as ``python -m MODULE ARGS`` (through ``tests/recipe_standins.py``) with only
``TINKER_BASE_URL`` / ``TINKER_API_KEY`` pointing at us. Sizes are shrunk through each recipe's
own command-line options (``max_steps=2``, small batches and token budgets).

What is stand-in (cannot be had offline):

* **Data, all generated:** GSM8K for ``rl_loop`` and Anthropic HH-RLHF for DPO (replacing
  ``datasets.load_dataset``), a Prophet Arena CSV for ``decisions`` (through the recipe's
  ``data_path`` option); see ``tests/recipe_standins.py`` and ``tests/cookbook_runner.py``.
  ``math_rl``'s arithmetic problems are the recipe's own generated data.
* **Model:** every recipe gets ``model_name=Qwen/Qwen3.5-9B-Base`` (``math_rl`` and
  ``decisions`` default to names we do not register), served by the offline tiny random model,
  with its Qwen3 tokenizer laid into a private Hub cache under that name.
* **rl_loop's model:** a random model never writes ``\\boxed{N}``, so every reward would be 0,
  every advantage 0, and rl_loop would skip its training step (and never send stable_reinforce).
  Its test runs on a stack of its own whose ``Qwen/Qwen3.5-9B-Base`` is the tiny model with
  scripted weights (``recipe_standins.write_boxed_answer_model``: a bigram chain that answers
  `` \\boxed{4}`` or `` \\boxed{5}`` with probability 1/2 each), and GSM8K stand-in answers of 4
  or 5, so groups get mixed rewards and the recipe trains.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker_cookbook")  # (the GPU conformance run's image has no cookbook)

TESTS = Path(__file__).resolve().parents[1]
RUNNER = TESTS / "recipe_standins.py"
MODEL = "Qwen/Qwen3.5-9B-Base"  # registered in openrl/data/models.toml (the tiny model)
RENDERER = "role_colon"  # model_info.get_recommended_renderer_name(MODEL)


def run_recipe(module: str, args: list[str], stack, api_key: str, models_dir: Path, log_path: Path) -> Path:
    """Run ``module`` to completion with ``log_path=`` and ``args``; return ``log_path``.
    Fails with the recipe's output tail."""
    env = {**os.environ, "TINKER_BASE_URL": stack.base_url, "TINKER_API_KEY": api_key, "TINKER_TELEMETRY": "0",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(log_path.parent / "hf"),
           "WANDB_MODE": "disabled", "OPENRL_TOKENIZER_STANDIN": str(models_dir / "tiny-qwen3"),
           "OPENRL_TOKENIZER_NAMES": MODEL}
    cmd = [sys.executable, str(RUNNER), module, f"log_path={log_path}", *args]
    p = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=400,
                       cwd=log_path.parent)
    assert p.returncode == 0, f"{module} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-6000:]}"
    return log_path


def metrics(log_path: Path) -> list[dict]:
    """The rows of the recipe's ``metrics.jsonl``."""
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def assert_finite(row: dict, keys) -> None:
    for k in keys:
        assert isinstance(row.get(k), (int, float)) and math.isfinite(row[k]), (k, row)


def final_checkpoint(log_path: Path) -> dict:
    rows = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]
    return next(r for r in reversed(rows) if r.get("name") == "final")


@pytest.fixture(scope="module")
def boxed_stack(tmp_path_factory, models_dir):
    """A stack whose ``Qwen/Qwen3.5-9B-Base`` is :func:`recipe_standins.write_boxed_answer_model`'s
    scripted model (the registry overlay ``<state>/models.toml``)."""
    from conftest import _make_stack
    from recipe_standins import write_boxed_answer_model

    model = write_boxed_answer_model(models_dir / "tiny-qwen3", tmp_path_factory.mktemp("boxed-model"))
    s = _make_stack(tmp_path_factory, models_dir)
    (s.state_dir / "models.toml").write_text(f'[models."{MODEL}"]\npath = "{model}"\n')
    s.start()
    yield s
    s.stop()


def trainer_metric(stack, name: str, **labels) -> float:
    """One sample of the stack's trainer Prometheus metrics (0.0 when absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(stack.metrics_urls["trainer"], timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_rl_loop_default_stable_reinforce_two_steps(boxed_stack, api_key, models_dir, tmp_path):
    log = run_recipe("tinker_cookbook.recipes.rl_loop", [
        "batch_size=2", "group_size=8", "max_tokens=8", "max_steps=2", "save_every=0",
    ], boxed_stack, api_key, models_dir, tmp_path / "rl_loop")
    rows = metrics(log)
    assert [m["step"] for m in rows] == [0, 1], rows
    for m in rows:
        assert_finite(m, ["reward/total", "time/total"])
        assert 0 < m["reward/total"] < 1, m  # the scripted model answers 4 or 5, half right
    trained = [m for m in rows if "grad_norm:mean" in m]  # rl_loop logs optim metrics only when it trained
    assert trained, rows
    for m in trained:
        assert_finite(m, ["grad_norm:mean"])
    # every training step was one forward_backward(loss_fn="stable_reinforce"), all answered ok
    assert trainer_metric(boxed_stack, "openrl_worker_requests_total", op="forward_backward", outcome="ok") \
        == len(trained)
    assert trainer_metric(boxed_stack, "openrl_worker_requests_total", op="forward_backward") == len(trained)
    assert final_checkpoint(log)["sampler_path"].startswith("tinker://")


def test_math_rl_default_loss_two_steps(stack, api_key, models_dir, tmp_path):
    log = run_recipe("tinker_cookbook.recipes.math_rl.train", [
        f"model_name={MODEL}", "groups_per_batch=2", "group_size=4", "max_steps=2",
        "eval_every=0", "save_every=0",
    ], stack, api_key, models_dir, tmp_path / "math_rl")
    rows = [m for m in metrics(log) if "optim/kl_sample_train_v1" in m]
    assert [m["step"] for m in rows] == [0, 1], metrics(log)
    for m in rows:
        assert_finite(m, ["optim/kl_sample_train_v1", "optim/kl_sample_train_v2", "env/all/reward/total"])
    assert final_checkpoint(log)["sampler_path"].startswith("tinker://")


def test_dpo_hhh_two_steps(stack, api_key, models_dir, tmp_path):
    log = run_recipe("tinker_cookbook.recipes.preference.dpo.train", [
        f"model_name={MODEL}", "batch_size=4", "max_length=256", "max_steps=2",
    ], stack, api_key, models_dir, tmp_path / "dpo")
    rows = [m for m in metrics(log) if "dpo_loss" in m]
    assert len(rows) == 2, metrics(log)
    for m in rows:
        assert_finite(m, ["dpo_loss", "accuracy", "margin"])
    assert rows[1]["margin"] != 0, rows  # the first step moved the policy off the reference
    # before any step the policy is the reference: DPO loss log(2)
    assert abs(rows[0]["dpo_loss"] - math.log(2)) < 1e-3, rows[0]


def test_decisions_forecasting_two_steps(stack, api_key, models_dir, tmp_path):
    from recipe_standins import write_prophet_arena_csv

    data = write_prophet_arena_csv(tmp_path / "prophet.csv", n_train_events=4, n_validation_events=2)
    log = run_recipe("tinker_cookbook.recipes.decisions.forecasting", [
        f"model_name={MODEL}", f"data_path={data}", "batch_size=3", "max_steps=2", "eval_every=0",
        "max_train_questions=6", "max_validation_questions=4",
    ], stack, api_key, models_dir, tmp_path / "decisions")
    rows = metrics(log)
    train = [m for m in rows if "train/loss" in m]
    assert [m["step"] for m in train] == [1, 2], rows
    for m in train:
        assert_finite(m, ["train/loss", "train/target_prob:mean", "train/accuracy"])
        assert 0 <= m["train/loss"] <= 2  # a Brier score of a yes / no distribution
    evals = [m for m in rows if "test/brier_reward" in m]
    assert [m["step"] for m in evals] == [0, 2], rows
    for m in evals:
        assert_finite(m, ["test/brier_reward", "test/accuracy"])
