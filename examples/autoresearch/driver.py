"""The autoresearch driver: keeps ``--parallel`` experiments running against one gateway
until ``--experiments`` have finished or ``--time-budget`` seconds have passed.

All experiments share one ``tinker.ServiceClient`` in one asyncio loop (the SDK's futures
are awaitable), so the trainer can pack their passes together. Each finished step goes to
the leaderboard and to the proposer (which may prune the experiment). Ctrl-C cancels the
running experiments and records them as ``interrupted``; running the same command again
reads ``<out>/leaderboard.jsonl`` (and, for optuna, ``<out>/optuna.db``), runs the
interrupted configs again as new experiments, and continues up to the same budget:
finished experiments are never redone. At the end the driver closes its session, so the
stack has no client left and can go idle.

Outputs in ``--out``: ``leaderboard.jsonl`` (format: leaderboard.py), ``leaderboard.txt``
(the rendered table), ``rewards.png`` (reward per step, one line per experiment),
``summary.json`` (counts, wall time, the best experiment), ``shop.db`` (text-to-SQL only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import tinker
from pydantic import ValidationError

from rl_loop import default_api_key, default_base_url

from . import leaderboard as lbm
from .experiment import ExperimentConfig, Pruned, StopRequested, run_experiment
from .proposers import DEFAULT_SPACE, CommandProposer, OptunaProposer, ProposerError, check_space
from .tasks import TaskContext


def _validation_message(e: ValidationError) -> str:
    return "; ".join(f"config.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())


class Driver:
    """One sweep (see the module docstring). ``args`` are the parsed command-line options."""

    def __init__(self, args: argparse.Namespace, console):
        self.args, self.console = args, console
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.lb = lbm.Leaderboard(self.out / "leaderboard.jsonl")
        self.ctx = TaskContext(self.out)
        space = json.loads(Path(args.space).read_text()) if args.space else DEFAULT_SPACE
        self.space = check_space(space)
        self.base = {"prompts": args.prompts, "max_tokens": args.max_tokens, "warmup_steps": args.warmup_steps,
                     "seed": args.seed}
        if args.proposer_command:
            self.proposer = CommandProposer(args.proposer_command, self.out, self.lb.path, self.space)
        else:
            self.proposer = OptunaProposer(self.out, self.space, seed=args.seed, pruner=args.pruner)
        self.deadline = time.monotonic() + args.time_budget if args.time_budget else None
        self._plot_preload = None  # lbm.preload_plotting()'s thread, started at the sweep's first step

    def time_up(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    async def run_one(self, service, exp_id: str, cfg: ExperimentConfig, handle) -> str:
        """Run one experiment to its end and record it; returns its status."""
        steps: list[dict] = []

        def on_step(rec: dict) -> None:
            if self._plot_preload is None:  # the first step of the sweep: the tokenizer has loaded
                self._plot_preload = lbm.preload_plotting()
            steps.append(rec)
            self.lb.step(exp_id, rec)
            loss = "-" if rec["loss"] is None else f"{rec['loss']:.4f}"
            self.console.print(f"{exp_id} step {rec['step']}: reward={rec['reward']:.3f} loss:sum={loss} "
                               f"({rec['seconds']:.1f} s)")
            if self.proposer.report(handle, rec["step"], rec["reward"]):
                raise Pruned()
            if self.time_up():
                raise StopRequested()

        error = None
        try:
            await run_experiment(service, self.args.model, cfg, self.args.steps, self.ctx, on_step)
            status = "completed"
        except Pruned:
            status = "pruned"
        except StopRequested:
            status = "stopped"
        except asyncio.CancelledError:
            self._end(exp_id, handle, "interrupted", steps)
            raise
        except Exception as e:  # noqa: BLE001 - a failed experiment is recorded, the sweep goes on
            status, error = "failed", f"{type(e).__name__}: {e}"
        self._end(exp_id, handle, status, steps, error)
        return status

    def _end(self, exp_id: str, handle, status: str, steps: list[dict], error: str | None = None) -> None:
        objective = steps[-1]["reward"] if steps else None
        self.lb.end(exp_id, status, objective, len(steps), error)
        self.proposer.finish(handle, status, objective)
        self.console.print(f"{exp_id} {status}" + (f": objective {objective:.3f}" if objective is not None else "")
                           + (f" ({error})" if error else ""))

    async def _propose(self):
        """``proposer.propose()`` in a thread (an external command may take a while). If the
        sweep is cancelled meanwhile, the proposal is still awaited and then finished as
        ``interrupted``, so the proposer holds no orphan (e.g. a RUNNING optuna trial)."""
        fut = asyncio.ensure_future(asyncio.to_thread(self.proposer.propose))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            prop = await fut
            if prop is not None:
                self.proposer.finish(prop.handle, "interrupted", None)
            raise

    async def sweep(self) -> dict:
        """Run until the budget is spent or the proposer has nothing more; returns the summary."""
        exps = self.lb.experiments()
        for e in exps.values():
            if e.status == "running":  # the previous driver died without writing its end
                self.lb.end(e.id, "interrupted", e.steps[-1]["reward"] if e.steps else None, len(e.steps))
                e.status = "interrupted"
        rerun_done = {e.rerun_of for e in exps.values()}
        requeue = [e for e in exps.values() if e.status == "interrupted" and e.id not in rerun_done]
        finished = sum(e.status in lbm.FINISHED for e in exps.values())
        next_idx = len(exps)
        if exps:
            self.console.print(f"resuming {self.lb.path}: {finished} finished, {len(requeue)} interrupted to run again")
        t0 = time.perf_counter()
        service = tinker.ServiceClient(base_url=self.args.base_url, api_key=default_api_key())
        running: dict[asyncio.Task, str] = {}
        exhausted = False
        close_status = "success"
        try:
            while True:
                while (not exhausted and not self.time_up() and len(running) < self.args.parallel
                       and finished + len(running) < self.args.experiments):
                    rerun_of = None
                    if requeue:
                        old = requeue.pop(0)
                        rerun_of = old.id
                        prop = self.proposer.adopt(dict(old.config))
                    else:
                        prop = await self._propose()
                        if prop is None:
                            exhausted = True
                            break
                    exp_id = f"e{next_idx:04d}"
                    next_idx += 1
                    try:
                        cfg = ExperimentConfig(**{**self.base, **prop.config})
                    except ValidationError as e:
                        self.lb.start(exp_id, prop.config, self.proposer.name, prop.handle)
                        self._end(exp_id, prop.handle, "failed", [], _validation_message(e))
                        finished += 1
                        continue
                    self.lb.start(exp_id, cfg.model_dump(), self.proposer.name, prop.handle, rerun_of)
                    self.console.print(f"{exp_id} start: {json.dumps(cfg.model_dump())}")
                    running[asyncio.create_task(self.run_one(service, exp_id, cfg, prop.handle))] = exp_id
                if not running:
                    break
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    running.pop(t)
                    finished += 1
        except BaseException:  # Ctrl-C (asyncio.run cancels this task) or a proposer error
            close_status = "interrupted"
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            raise
        finally:
            await asyncio.to_thread(lambda: service.close(close_status).result(timeout=30))
            self.report(time.perf_counter() - t0)
        return json.loads((self.out / "summary.json").read_text())

    def report(self, wall_s: float) -> None:
        """Write leaderboard.txt, rewards.png and summary.json, and print the table."""
        exps = list(self.lb.experiments().values())
        lbm.plot(self.out / "rewards.png", exps)
        lbm.write_table(self.out / "leaderboard.txt", exps)
        self.console.print(lbm.render_table(exps))
        scored = [e for e in exps if e.status == "completed" and e.objective is not None]
        best = max(scored, key=lambda e: e.objective, default=None)
        counts: dict[str, int] = {}
        for e in exps:
            counts[e.status] = counts.get(e.status, 0) + 1
        summary = {"experiments": len(exps), "by_status": counts, "last_wall_s": round(wall_s, 3),
                   "best": None if best is None else {"id": best.id, "objective": best.objective, "config": best.config}}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if best is not None:
            self.console.print(f"best: {best.id} objective {best.objective:.3f} {json.dumps(best.config)}")
        self.console.print(f"wrote {self.lb.path}, {self.out / 'leaderboard.txt'}, {self.out / 'rewards.png'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="autoresearch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=default_base_url())
    ap.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507")
    ap.add_argument("--out", default="autoresearch-out", help="leaderboard, plot, optuna.db (resume from here)")
    ap.add_argument("--experiments", type=int, default=8, help="experiments to finish in all (the budget)")
    ap.add_argument("--parallel", type=int, default=4, help="experiments running at once")
    ap.add_argument("--steps", type=int, default=5, help="RL steps per experiment")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds; after it no experiment starts and running ones stop after their current step")
    ap.add_argument("--space", default=None, help="search space JSON file (default: proposers.DEFAULT_SPACE)")
    ap.add_argument("--pruner", default="median", help="optuna pruner: median | none | threshold:X")
    ap.add_argument("--proposer-command", default=None,
                    help="an external proposer (see proposers.CommandProposer) instead of optuna")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step (default of the config field)")
    ap.add_argument("--max-tokens", type=int, default=6, help="sampled tokens per answer (config default)")
    ap.add_argument("--warmup-steps", type=int, default=0, help="SFT steps before RL, arithmetic (config default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("experiments", "parallel", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    console = Console(emoji=False, highlight=False)
    try:
        driver = Driver(args, console)
        asyncio.run(driver.sweep())
    except KeyboardInterrupt:
        console.print(f"interrupted; run the same command again to resume from {Path(args.out) / 'leaderboard.jsonl'}")
        return 130
    except (ProposerError, ValueError) as e:
        console.print(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
