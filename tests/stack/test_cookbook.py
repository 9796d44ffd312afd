"""tinker-cookbook's basic recipes, unmodified, against the embedded stack: ``sl_basic`` (SFT)
and ``rl_basic`` (GRPO-style RL on GSM8K) for 2 steps each, each as ``python -m
tinker_cookbook.recipes.<name> ARGS`` with only ``TINKER_BASE_URL`` / ``TINKER_API_KEY``
pointing at us (through ``tests/cookbook_runner.py``).

What stands in for what cannot be had offline (see ``cookbook_runner.py``):

* the recipes' model ``Qwen/Qwen3.5-9B-Base`` is served by the offline tiny model (registry
  entry in ``openrl/data/models.toml``), and its tokenizer is the offline model's, laid into a
  private Hugging Face Hub cache (``HF_HUB_OFFLINE=1``);
* the HF datasets (``HuggingFaceH4/no_robots``, ``openai/gsm8k``) are small generated
  datasets with the real columns (``datasets.load_dataset`` replaced, nothing else).

Sizes come from the recipes' own command-line options (chz): ``max_steps=2``, and the
recipe's own dataset builder class re-specified with a small batch (the blueprint's values
cannot be overridden field by field), ``max_tokens=8`` for RL. The RL run reports the
cookbook's sampler-vs-trainer logprob comparison, ``optim/kl_sample_train_v1`` (mean of
sampler logprob - trainer logprob over sampled tokens) and ``_v2`` (half the mean square):
sampler and trainer share one logprob computation here, so both are ~0.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tolerances import TOL, measured

pytest.importorskip("tinker_cookbook")  # (the GPU conformance run's image has no cookbook)

RUNNER = Path(__file__).resolve().parents[1] / "cookbook_runner.py"
MODEL = "Qwen/Qwen3.5-9B-Base"  # the basic recipes' DEFAULT_MODEL_NAME
RENDERER = "role_colon"  # model_info.get_recommended_renderer_name(MODEL)


def run_recipe(module: str, args: list[str], stack, api_key: str, models_dir: Path, tmp: Path) -> Path:
    """Run a recipe to completion; return its log_path. Fails with the recipe's output tail."""
    log_path = tmp / module.rsplit(".", 1)[-1]
    env = {**os.environ, "TINKER_BASE_URL": stack.base_url, "TINKER_API_KEY": api_key, "TINKER_TELEMETRY": "0",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp / "hf"), "WANDB_MODE": "disabled",
           "OPENRL_TOKENIZER_STANDIN": str(models_dir / "tiny-qwen3"), "OPENRL_TOKENIZER_NAMES": MODEL}
    cmd = [sys.executable, str(RUNNER), module, f"log_path={log_path}", "max_steps=2", *args]
    p = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{module} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-6000:]}"
    return log_path


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def final_checkpoints(log_path: Path) -> dict:
    rows = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]
    return next(r for r in reversed(rows) if r.get("name") == "final")


def test_cookbook_is_the_newest_installable_release():
    import importlib.metadata as md

    assert tuple(int(x) for x in md.version("tinker-cookbook").split(".")[:2]) >= (0, 6)


def test_sl_basic_two_steps(stack, api_key, models_dir, tmp_path):
    import tinker

    log = run_recipe("tinker_cookbook.recipes.sl_basic", [
        "eval_every=0", "save_every=0",
        "dataset_builder=tinker_cookbook.recipes.chat_sl.chat_datasets:NoRobotsBuilder",
        f"dataset_builder.common_config.model_name_for_tokenizer={MODEL}",
        f"dataset_builder.common_config.renderer_name={RENDERER}",
        "dataset_builder.common_config.batch_size=8", "dataset_builder.common_config.max_length=512",
        "dataset_builder.common_config.train_on_what=all_assistant_messages",
    ], stack, api_key, models_dir, tmp_path)
    rows = [m for m in metrics(log) if "train_mean_nll" in m]
    assert len(rows) == 2, rows
    assert all(math.isfinite(m["train_mean_nll"]) and m["num_sequences"] == 8 for m in rows)
    final = final_checkpoints(log)
    rest = tinker.ServiceClient(base_url=stack.base_url, api_key=api_key).create_rest_client()
    run_id = final["state_path"].split("/")[2]
    listed = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert {final["state_path"], final["sampler_path"]} <= listed
    assert rest.get_training_run(run_id).result().base_model == MODEL


def test_rl_basic_two_steps_and_sampler_trainer_logprob_gap(stack, api_key, models_dir, tmp_path, record_property):
    log = run_recipe("tinker_cookbook.recipes.rl_basic", [
        "max_tokens=8",
        "dataset_builder=tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder",
        "dataset_builder.batch_size=2", "dataset_builder.group_size=4",
        f"dataset_builder.model_name_for_tokenizer={MODEL}", f"dataset_builder.renderer_name={RENDERER}",
    ], stack, api_key, models_dir, tmp_path)
    rows = [m for m in metrics(log) if "optim/kl_sample_train_v1" in m]
    assert len(rows) == 2, metrics(log)
    for m in rows:
        v1, v2 = m["optim/kl_sample_train_v1"], m["optim/kl_sample_train_v2"]
        print(f"step {m['step']}: kl_sample_train_v1={v1:.3e} kl_sample_train_v2={v2:.3e}")
        record_property(f"kl_sample_train_v1_step{m['step']}", v1)
        measured("kl_sample_train", abs(v1), TOL.kl_sample_train, step=m["step"])
        measured("kl_sample_train_v2", v2, TOL.kl_sample_train_v2, step=m["step"])
        # the cookbook's healthy dense-model runs are ~2e-4; on CPU ours share the numerics exactly
        assert abs(v1) <= TOL.kl_sample_train and 0 <= v2 <= TOL.kl_sample_train_v2, m
    assert final_checkpoints(log)["sampler_path"].startswith("tinker://")
