"""Text-to-SQL with RL against a real SQLite database, with the public Tinker SDK only.

Each step: save the current weights and get a sampling client; sample a group of SQL
answers for each of a few training questions (GRPO-style groups); run every answer on a
read-only connection to the generated shop database and reward it 1 if its result set
equals the gold query's (0 for a wrong result, malformed SQL, a write attempt, a timeout
or too many rows); normalise the rewards within each group (the advantages) and train
with the ``importance_sampling`` loss on the sampler's logprobs. A fixed held-out slice
of test questions is answered greedily for the execution accuracy.

Per step it prints and appends to ``<out-dir>/metrics.csv``: the mean reward, the
fraction of sampled answers that were valid SQL, and the held-out execution accuracy.
Every ``--save-every`` steps (and at the end) it saves the training state (weights +
optimizer) and records it in ``<out-dir>/state.json``; run the same command again after
an interruption and it continues from that step (``--fresh`` starts over).

    python examples/text_to_sql_rl.py --steps 20                # against $TINKER_BASE_URL
    openrl run examples/text_to_sql_rl.py -- --steps 20         # against a fresh embedded stack

Data and reward: ``examples/text_to_sql/``. The built offline model has random weights,
so its rewards stay at 0; the recipe is meant for a real instruct model (see
docs/recipes/text_to_sql_rl.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import tinker
from tinker import types
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from text_to_sql import SQLEnv, build_database, make_examples, sft_datum, split_examples  # noqa: E402
from text_to_sql.prompts import end_of_turn_id, prompt_tokens  # noqa: E402

CSV_FIELDS = ["step", "mean_reward", "valid_sql_frac", "eval_exec_acc", "eval_valid_sql_frac", "loss_sum",
              "n_datums", "n_samples", "step_seconds", "checkpoint"]


def default_api_key() -> str | None:
    """$TINKER_API_KEY, else the embedded stack's generated key in $OPENRL_HOME/api_key."""
    if os.environ.get("TINKER_API_KEY"):
        return os.environ["TINKER_API_KEY"]
    f = Path(os.environ.get("OPENRL_HOME", Path.home() / ".openrl")) / "api_key"
    return f.read_text().strip() if f.exists() else None


def group_advantages(rewards: list[float]) -> list[float]:
    """GRPO advantages: reward minus the group mean, divided by the group std (+1e-6)."""
    r = np.asarray(rewards, dtype=np.float64)
    return list((r - r.mean()) / (r.std() + 1e-6))


def read_state(path: Path) -> dict | None:
    """The resume record ``{"step", "state_path", ...}``, or None if there is none."""
    if not path.exists():
        return None
    return json.loads(path.read_text())


def write_state(path: Path, record: dict) -> None:
    """Write the resume record atomically (a temp file, then a rename)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def open_metrics(path: Path, keep_below: int) -> None:
    """Start ``metrics.csv`` with its header, keeping only the rows of steps < ``keep_below``
    (rows of steps after the last saved state are redone on resume)."""
    rows = []
    if keep_below > 0 and path.exists():
        with path.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if int(r["step"]) < keep_below]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)


def append_metrics(path: Path, row: dict) -> None:
    with path.open("a", newline="") as f:
        csv.DictWriter(f, fieldnames=CSV_FIELDS).writerow(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"))
    ap.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507")
    ap.add_argument("--steps", type=int, default=20, help="total RL steps (a resumed run continues up to this)")
    ap.add_argument("--questions", type=int, default=4, help="training questions per step")
    ap.add_argument("--group", type=int, default=4, help="samples per question (the GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--eval-size", type=int, default=8, help="held-out test questions answered greedily")
    ap.add_argument("--eval-every", type=int, default=1, help="evaluate every N steps (0: never)")
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="supervised steps on gold SQL before RL, on a fresh start (for a model that cannot "
                         "write SQL yet)")
    ap.add_argument("--warmup-batch", type=int, default=8)
    ap.add_argument("--drop-constant-groups", action="store_true",
                    help="skip groups whose rewards are all equal (their advantages are 0)")
    ap.add_argument("--out-dir", default="runs/text_to_sql_rl", help="metrics.csv, state.json and shop.db go here")
    ap.add_argument("--db", help="SQLite file (default <out-dir>/shop.db, generated if missing)")
    ap.add_argument("--save-every", type=int, default=5, help="save the training state every N steps")
    ap.add_argument("--fresh", action="store_true", help="ignore state.json and start over")
    ap.add_argument("--timeout-s", type=float, default=1.0, help="time limit per SQL query")
    ap.add_argument("--max-rows", type=int, default=1000, help="row limit per SQL query")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, state_path = out / "metrics.csv", out / "state.json"
    env = SQLEnv(build_database(Path(args.db) if args.db else out / "shop.db"),
                 timeout_s=args.timeout_s, max_rows=args.max_rows)
    train, test = split_examples(make_examples())
    held_out = test[:args.eval_size]
    print(f"{len(train)} train / {len(test)} test questions; held-out slice {len(held_out)}; db {env.db_path}")

    state = None if args.fresh else read_state(state_path)
    if state is not None:
        if state.get("base_model") not in (None, args.model):
            sys.exit(f"{state_path} is a {state['base_model']} run, not {args.model}: use --fresh or another --out-dir")
        if int(state["step"]) >= args.steps:
            print(f"resuming from step {state['step']}: nothing to do for --steps {args.steps} "
                  f"(raise --steps to continue; last state {state['state_path']})")
            return
    service = tinker.ServiceClient(base_url=args.base_url, api_key=default_api_key())
    if state is not None:
        training = service.create_training_client_from_state_with_optimizer(state["state_path"]).result()
        start = int(state["step"])
        print(f"resuming from step {start}: {state['state_path']}")
    else:
        training = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=args.seed).result()
        start = 0
    tokenizer = training.get_tokenizer()
    adam = types.AdamParams(learning_rate=args.lr)
    open_metrics(csv_path, keep_below=start)
    print(f"training run {training.model_id} on {args.model}; metrics -> {csv_path}")

    if state is None and args.warmup_steps:
        rng = random.Random(args.seed + 1)
        bar = tqdm(range(args.warmup_steps), desc="warm-up (SFT)")
        for _ in bar:
            fb = training.forward_backward([sft_datum(tokenizer, e) for e in rng.sample(train, args.warmup_batch)],
                                           "cross_entropy")
            training.optim_step(adam).result()
            bar.set_postfix(loss=f"{fb.result().metrics['loss:sum']:.2f}")

    bar = tqdm(range(start, args.steps), desc="RL text-to-SQL", initial=start, total=args.steps)
    try:
        run_steps(args, bar, training, tokenizer, env, train, held_out, adam, csv_path, state_path)
    except KeyboardInterrupt:
        last = read_state(state_path)
        where = f"step {last['step']} ({last['state_path']})" if last else "the beginning (nothing saved yet)"
        sys.exit(f"\ninterrupted; the same command resumes from {where}")
    print(f"done: {args.steps} steps; metrics in {csv_path}; resume record in {state_path}")


def run_steps(args, bar, training, tokenizer, env: SQLEnv, train, held_out, adam, csv_path: Path,
              state_path: Path) -> None:
    """The RL steps of ``bar`` (see the module docstring)."""
    stop = [end_of_turn_id(tokenizer)]
    sample_params = types.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop=stop)
    greedy = types.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop=stop)
    for step in bar:
        t0 = time.time()
        sampler = training.save_weights_and_get_sampling_client().result()
        batch = random.Random(args.seed * 1_000_003 + step).sample(train, args.questions)
        jobs = []
        for e in batch:
            prompt = types.ModelInput.from_ints(prompt_tokens(tokenizer, e.question))
            jobs.append((e, prompt, sampler.sample(prompt, num_samples=args.group, sampling_params=sample_params)))
        evaluate = args.eval_every > 0 and (step % args.eval_every == 0 or step + 1 == args.steps)
        eval_jobs = []
        if evaluate:
            for e in held_out:
                prompt = types.ModelInput.from_ints(prompt_tokens(tokenizer, e.question))
                eval_jobs.append((e, sampler.sample(prompt, num_samples=1, sampling_params=greedy)))

        data, rewards_all, valid_all = [], [], []
        for e, prompt, fut in jobs:
            seqs = fut.result().sequences
            scored = [env.reward(tokenizer.decode(s.tokens, skip_special_tokens=True), e) for s in seqs]
            rewards = [r for r, _ in scored]
            rewards_all += rewards
            valid_all += [res.ok for _, res in scored]
            if args.drop_constant_groups and len(set(rewards)) == 1:
                continue
            n_prompt = prompt.length
            for s, adv in zip(seqs, group_advantages(rewards)):
                if not s.tokens:
                    continue
                toks = prompt.to_ints() + list(s.tokens)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={
                        "target_tokens": toks[1:],
                        "logprobs": [0.0] * (n_prompt - 1) + list(s.logprobs),
                        "advantages": [0.0] * (n_prompt - 1) + [float(adv)] * len(s.tokens),
                    },
                ))
        eval_acc = eval_valid = None
        if evaluate:
            ev = [env.reward(tokenizer.decode(fut.result().sequences[0].tokens, skip_special_tokens=True), e)
                  for e, fut in eval_jobs]
            eval_acc = float(np.mean([r for r, _ in ev])) if ev else None
            eval_valid = float(np.mean([res.ok for _, res in ev])) if ev else None
        loss = None
        if data:
            fb = training.forward_backward(data, "importance_sampling")
            training.optim_step(adam).result()
            loss = fb.result().metrics["loss:sum"]

        row = {
            "step": step,
            "mean_reward": round(float(np.mean(rewards_all)), 4),
            "valid_sql_frac": round(float(np.mean(valid_all)), 4),
            "eval_exec_acc": "" if eval_acc is None else round(eval_acc, 4),
            "eval_valid_sql_frac": "" if eval_valid is None else round(eval_valid, 4),
            "loss_sum": "" if loss is None else round(loss, 6),
            "n_datums": len(data),
            "n_samples": len(rewards_all),
            "step_seconds": round(time.time() - t0, 2),
            "checkpoint": "",
        }
        done = step + 1
        if done % args.save_every == 0 or done == args.steps:
            row["checkpoint"] = training.save_state(f"text-to-sql-step-{done:05d}").result().path
        append_metrics(csv_path, row)
        if row["checkpoint"]:
            write_state(state_path, {"step": done, "state_path": row["checkpoint"], "base_model": args.model,
                                     "model_id": training.model_id, "seed": args.seed,
                                     "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        bar.set_postfix(reward=row["mean_reward"], valid=row["valid_sql_frac"], eval_acc=row["eval_exec_acc"])
        tqdm.write(f"step {step}: mean_reward={row['mean_reward']} valid_sql={row['valid_sql_frac']} "
                   f"eval_exec_acc={row['eval_exec_acc']} loss:sum={row['loss_sum']} datums={len(data)} "
                   f"step_s={row['step_seconds']}" + (f" saved {row['checkpoint']}" if row["checkpoint"] else ""))


if __name__ == "__main__":
    main()
