"""A learning-rate sweep: N RL runs of examples/rl_loop.py's task at once against one gateway.

All runs share one ``tinker.ServiceClient`` and run concurrently in one asyncio loop (the
SDK's futures are awaitable); the trainer packs their forward/backward passes together.
Live progress shows one bar per run; at the end the script writes

    <out>/sweep.csv    one row per (phase, run, step): lr, mean reward, loss:sum, seconds
    <out>/sweep.png    reward and loss per step, one line per run (the parallel phase)
    <out>/sweep.json   wall times and the speed-up

and reports how much faster the sweep was than running the same runs one after another.
Both are MEASURED: after the parallel sweep, the same runs (same seeds, same problems)
run again sequentially, each to completion before the next starts (``--no-sequential``
skips that and estimates the sequential time as N x the mean single-run time of the
sweep instead, which flatters the sweep less than it seems: each run of the sweep was
slowed by sharing the service). Model loading is not timed: a warm-up run goes first.

    python examples/sweep.py --runs 3 --steps 5                    # against $TINKER_BASE_URL
    openrl run examples/sweep.py -- --runs 3 --steps 5 --out sweep-out
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_loop import (default_api_key, default_base_url, group_advantages, make_problems, reward,  # noqa: E402
                     sft_datum, shared_tokenizer)


@dataclass
class StepRecord:
    """One RL step of one run (seconds are wall-clock)."""

    phase: str  # "parallel" or "sequential"
    run: str
    lr: float
    step: int
    mean_reward: float
    loss: float
    step_seconds: float
    elapsed_seconds: float  # since the run started


def learning_rates(args) -> list[float]:
    """``--lrs`` if given, else ``--runs`` values spaced geometrically in [lr-min, lr-max]."""
    if args.lrs:
        return [float(x) for x in args.lrs.split(",")]
    if args.runs == 1:
        return [args.lr_min]
    return [float(x) for x in np.geomspace(args.lr_min, args.lr_max, args.runs)]


async def run_one(service, lr: float, args, *, phase: str, on_step=None) -> list[StepRecord]:
    """One RL run (optional SFT warm-up, then ``args.steps`` GRPO steps) at learning rate ``lr``.

    The run's problems depend only on ``args.seed``, so every run (and both phases) sees
    the same data and differs only by learning rate.

    Raises:
        tinker.APIError (and subclasses): the service failed a request.
    """
    name = f"lr={lr:.2g}"
    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    training = await service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=args.seed)
    tok = await shared_tokenizer(training, args.model)
    adam = types.AdamParams(learning_rate=lr)
    if args.warmup_steps:
        pool = make_problems(32, random.Random(args.seed + 1), args.max_operand)
        for _ in range(args.warmup_steps):
            batch = [sft_datum(tok, q, f" {a}") for q, a in rng.sample(pool, 8)]
            fb = training.forward_backward(batch, "cross_entropy")
            opt = training.optim_step(adam)
            await fb
            await opt
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=["\n"])
    records = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        sampler = await training.save_weights_and_get_sampling_client()
        problems = make_problems(args.problems, rng, args.max_operand)
        prompts = [types.ModelInput.from_ints(tok.encode(q, add_special_tokens=False)) for q, _ in problems]
        results = await asyncio.gather(*(
            sampler.sample(p, num_samples=args.group, sampling_params=params).result_async() for p in prompts))
        data, rewards_all = [], []
        for prompt, (_, answer), res in zip(prompts, problems, results):
            rewards = [reward(tok.decode(s.tokens), answer) for s in res.sequences]
            rewards_all += rewards
            for s, adv in zip(res.sequences, group_advantages(rewards)):
                if not s.tokens:
                    continue
                toks = prompt.to_ints() + list(s.tokens)
                n = prompt.length
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={"target_tokens": toks[1:],
                                    "logprobs": [0.0] * (n - 1) + list(s.logprobs),
                                    "advantages": [0.0] * (n - 1) + [adv] * len(s.tokens)},
                ))
        fb = training.forward_backward(data, "importance_sampling")
        opt = training.optim_step(adam)
        loss = (await fb).metrics["loss:sum"]
        await opt
        now = time.perf_counter()
        rec = StepRecord(phase, name, lr, step, float(np.mean(rewards_all)), float(loss), now - t0, now - t_start)
        records.append(rec)
        if on_step is not None:
            on_step(rec)
    return records


async def warm_up(service, args) -> float:
    """One untimed step through trainer and sampler so model loading is not in the timings (seconds)."""
    t0 = time.perf_counter()
    quick = argparse.Namespace(**{**vars(args), "steps": 1, "warmup_steps": 0, "problems": 1, "group": 1})
    await run_one(service, args.lr_min, quick, phase="warm-up")
    return time.perf_counter() - t0


def write_csv(path: Path, records: list[StepRecord]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(records[0])))
        w.writeheader()
        for r in records:
            w.writerow(asdict(r))


def plot(path: Path, records: list[StepRecord], title: str) -> None:
    """Reward and loss per step, one line per run (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    for run in dict.fromkeys(r.run for r in records):
        rs = [r for r in records if r.run == run]
        ax_r.plot([r.step for r in rs], [r.mean_reward for r in rs], marker="o", label=run)
        ax_l.plot([r.step for r in rs], [r.loss for r in rs], marker="o", label=run)
    ax_r.set(xlabel="RL step", ylabel="mean reward", title="reward")
    ax_l.set(xlabel="RL step", ylabel="loss:sum (importance_sampling)", title="loss")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_r, ax_l):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def sweep(args) -> dict:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(emoji=False, highlight=False)
    lrs = learning_rates(args)
    service = tinker.ServiceClient(base_url=args.base_url, api_key=default_api_key())
    console.print(f"sweep of {len(lrs)} runs x {args.steps} RL steps on {args.model} at {args.base_url}: "
                  f"lr in {', '.join(f'{lr:.2g}' for lr in lrs)}")
    warm = await warm_up(service, args)
    console.print(f"warm-up (model loading, not timed): {warm:.1f} s")

    def progress_bar():
        return Progress(TextColumn("{task.description:>14}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), console=console)

    async def phase(name: str, concurrent: bool) -> tuple[list[StepRecord], float, list[float]]:
        with progress_bar() as progress:
            tasks = {lr: progress.add_task(f"{name} lr={lr:.2g}", total=args.steps, stats="") for lr in lrs}

            def on_step(rec: StepRecord) -> None:
                progress.update(tasks[rec.lr], advance=1,
                                stats=f"reward {rec.mean_reward:.2f}  loss {rec.loss:8.3f}")
                progress.console.print(f"\\[{name}] {rec.run} step {rec.step}: reward={rec.mean_reward:.3f} "
                                       f"loss:sum={rec.loss:.4f} ({rec.step_seconds:.1f} s)")

            t0 = time.perf_counter()
            if concurrent:
                per_run = await asyncio.gather(*(run_one(service, lr, args, phase=name, on_step=on_step) for lr in lrs))
            else:
                per_run = [await run_one(service, lr, args, phase=name, on_step=on_step) for lr in lrs]
            wall = time.perf_counter() - t0
        run_walls = [recs[-1].elapsed_seconds if recs else 0.0 for recs in per_run]
        return [r for recs in per_run for r in recs], wall, run_walls

    records, par_wall, par_runs = await phase("parallel", True)
    summary = {"runs": len(lrs), "steps": args.steps, "learning_rates": lrs, "parallel_wall_s": round(par_wall, 3),
               "parallel_run_wall_s": [round(x, 3) for x in par_runs]}
    if args.sequential:
        seq_records, seq_wall, seq_runs = await phase("sequential", False)
        records += seq_records
        summary.update(sequential_wall_s=round(seq_wall, 3), sequential_run_wall_s=[round(x, 3) for x in seq_runs],
                       sequential_source="measured")
    else:
        seq_wall = float(np.mean(par_runs)) * len(lrs)
        summary.update(sequential_wall_s=round(seq_wall, 3), sequential_source="estimated: runs x mean run time")
    summary["speedup"] = round(seq_wall / par_wall, 3) if par_wall > 0 else None

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "sweep.csv", records)
    plot(out / "sweep.png", [r for r in records if r.phase == "parallel"],
         f"lr sweep: {len(lrs)} runs in parallel ({par_wall:.0f} s; {summary['speedup']}x faster than one by one)")
    (out / "sweep.json").write_text(json.dumps(summary, indent=2) + "\n")

    from rich.table import Table

    t = Table(title="final step per run (parallel phase)", title_justify="left")
    for c in ("run", "lr", "reward", "loss:sum", "run wall s"):
        t.add_column(c)
    for lr, wall in zip(lrs, par_runs):
        last = [r for r in records if r.phase == "parallel" and r.lr == lr][-1]
        t.add_row(last.run, f"{lr:.3g}", f"{last.mean_reward:.3f}", f"{last.loss:.4f}", f"{wall:.1f}")
    console.print(t)
    console.print(f"sweep: {par_wall:.1f} s for {len(lrs)} runs in parallel; one after another: {seq_wall:.1f} s "
                  f"({summary['sequential_source']}) -> {summary['speedup']}x faster")
    console.print(f"wrote {out / 'sweep.csv'}, {out / 'sweep.png'}, {out / 'sweep.json'}")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=default_base_url())
    ap.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507")
    ap.add_argument("--runs", type=int, default=3, help="runs in the sweep (learning rates)")
    ap.add_argument("--lrs", default=None, help="comma-separated learning rates (overrides --runs/--lr-min/--lr-max)")
    ap.add_argument("--lr-min", type=float, default=1e-3)
    ap.add_argument("--lr-max", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=10, help="RL steps per run")
    ap.add_argument("--warmup-steps", type=int, default=12, help="supervised steps before RL (0 for a real model)")
    ap.add_argument("--problems", type=int, default=4, help="problems per step")
    ap.add_argument("--group", type=int, default=4, help="samples per problem")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--max-operand", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="sweep-out", help="directory for sweep.csv / sweep.png / sweep.json")
    ap.add_argument("--no-sequential", dest="sequential", action="store_false",
                    help="do not re-run the runs one by one; estimate the sequential time instead")
    args = ap.parse_args(argv)
    asyncio.run(sweep(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
