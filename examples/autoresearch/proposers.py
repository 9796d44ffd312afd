"""Proposers: where the next experiment's config comes from.

A proposer has four methods (the driver calls them from one thread at a time):

* ``propose() -> Proposal | None``: the next config (a dict of
  :class:`~autoresearch.experiment.ExperimentConfig` fields; missing fields take the
  driver's defaults), or None when it has nothing more to propose;
* ``adopt(config) -> Proposal``: take over a config the driver runs again (an experiment
  interrupted by Ctrl-C, on resume), so the proposer knows it is running;
* ``report(handle, step, reward) -> bool``: a step's mean reward; True means prune (stop
  this experiment now);
* ``finish(handle, status, objective)``: the experiment ended (``status`` as in the
  leaderboard: completed / pruned / stopped / failed / interrupted; ``objective`` is the
  last step's reward or None).

Built in: :class:`OptunaProposer` (TPE search with a pruner, its study in
``<out>/optuna.db``) and :class:`CommandProposer` (an external program, e.g. an agent, that
reads the leaderboard and prints the next config as JSON).

A search space is a dict ``{field: spec}``: a list is a categorical choice, ``{"low": a,
"high": b, "log": bool}`` a range (float for float fields, int for int fields), anything
else a fixed value.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .experiment import ExperimentConfig

DEFAULT_SPACE: dict[str, Any] = {
    "learning_rate": {"low": 1e-3, "high": 3e-2, "log": True},
    "rank": [4, 8, 16],
    "loss": ["importance_sampling", "ppo", "stable_reinforce"],
    "group_size": [2, 4],
    "reward": ["arithmetic/exact", "arithmetic/shaped", "arithmetic/distance"],
}


class ProposerError(RuntimeError):
    """A proposer could not produce a proposal (e.g. the external command failed)."""


@dataclass
class Proposal:
    """A config to run, and the proposer's own reference to it (optuna: the trial number)."""

    config: dict
    handle: Any = None


def check_space(space: dict) -> dict:
    """Validate a search space's keys and specs.

    Raises:
        ValueError: an unknown field (``space.<key>``), an empty choice list, or a range
            without ``low`` < ``high``.
    """
    fields = ExperimentConfig.model_fields
    for k, spec in space.items():
        if k not in fields:
            raise ValueError(f"space.{k}: not a config field (fields: {', '.join(fields)})")
        if isinstance(spec, list) and not spec:
            raise ValueError(f"space.{k}: empty list of choices")
        if isinstance(spec, dict) and not (set(spec) <= {"low", "high", "log"} and spec.get("low", 0) < spec.get("high", 0)):
            raise ValueError(f"space.{k}: a range is {{'low': a, 'high': b, 'log': bool}} with a < b; got {spec}")
    return space


class OptunaProposer:
    """Optuna's TPE sampler over a search space, maximising the experiment's objective (its
    last step's mean reward), with a pruner fed each step's mean reward.

    The study lives in ``<out_dir>/optuna.db`` (SQLite), so a restarted driver continues it
    (its sampler then seeded with ``seed + trials so far``, so it does not repeat the first
    run's random proposals); trials still RUNNING when it opens (the previous driver was
    killed) are marked FAIL.

    Args:
        pruner: ``"median"`` (MedianPruner: prune when the step's reward is below the median
            of finished trials at that step, after 2 finished trials and from step 1 on),
            ``"none"``, or ``"threshold:X"`` (ThresholdPruner: prune a trial whose step reward
            is below X, from step 0 on).
    """

    name = "optuna"

    def __init__(self, out_dir: Path, space: dict, seed: int = 0, pruner: str = "median",
                 study_name: str = "autoresearch"):
        import optuna

        self.optuna = optuna
        self.space = check_space(space)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = f"sqlite:///{Path(out_dir).resolve() / 'optuna.db'}"
        self.study = optuna.create_study(
            study_name=study_name, storage=storage, direction="maximize", load_if_exists=True,
            pruner=self._pruner(pruner), sampler=optuna.samplers.TPESampler(seed=seed, constant_liar=True))
        if self.study.trials:  # resumed: a sampler seeded as before would propose the same configs again
            self.study = optuna.load_study(
                study_name=study_name, storage=storage, pruner=self._pruner(pruner),
                sampler=optuna.samplers.TPESampler(seed=seed + len(self.study.trials), constant_liar=True))
        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            self.study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        self._trials: dict[int, Any] = {}

    def _pruner(self, spec: str):
        p = self.optuna.pruners
        if spec == "median":
            return p.MedianPruner(n_startup_trials=2, n_warmup_steps=1)
        if spec == "none":
            return p.NopPruner()
        if spec.startswith("threshold:"):
            return p.ThresholdPruner(lower=float(spec.split(":", 1)[1]))
        raise ValueError(f"--pruner: {spec!r} is not median, none or threshold:X")

    def _suggest(self, trial) -> dict:
        fields = ExperimentConfig.model_fields
        cfg = {}
        for k, spec in self.space.items():
            if isinstance(spec, list):
                cfg[k] = trial.suggest_categorical(k, spec)
            elif isinstance(spec, dict):
                if fields[k].annotation is int:
                    cfg[k] = trial.suggest_int(k, int(spec["low"]), int(spec["high"]), log=bool(spec.get("log")))
                else:
                    cfg[k] = trial.suggest_float(k, float(spec["low"]), float(spec["high"]), log=bool(spec.get("log")))
            else:
                cfg[k] = spec
        return cfg

    def propose(self) -> Proposal:
        trial = self.study.ask()
        self._trials[trial.number] = trial
        return Proposal(self._suggest(trial), trial.number)

    def adopt(self, config: dict) -> Proposal:
        params = {k: config[k] for k, spec in self.space.items() if isinstance(spec, (list, dict)) and k in config}
        self.study.enqueue_trial(params)
        prop = self.propose()
        return Proposal({**config, **prop.config}, prop.handle)

    def report(self, handle, step: int, reward: float) -> bool:
        trial = self._trials[handle]
        trial.report(reward, step)
        return trial.should_prune()

    def finish(self, handle, status: str, objective: float | None) -> None:
        state = self.optuna.trial.TrialState
        self._trials.pop(handle, None)
        if status == "completed" and objective is not None:
            self.study.tell(handle, objective)
        elif status in ("pruned", "stopped"):
            self.study.tell(handle, state=state.PRUNED)  # its last reported step is its value
        else:
            self.study.tell(handle, state=state.FAIL)


class CommandProposer:
    """An external program proposes each config: the driver runs ``command`` (split with
    shlex; no shell) whenever a slot is free, with the environment variables

    * ``AUTORESEARCH_LEADERBOARD``: the leaderboard JSONL file (see leaderboard.py);
    * ``AUTORESEARCH_OUT``: the output directory;
    * ``AUTORESEARCH_SPACE``: the search space as JSON (a hint; the command may propose any
      valid config);
    * ``AUTORESEARCH_RUNNING``: how many experiments are running now,

    and reads the last non-empty line of its stdout: a JSON object of config fields, or
    ``null`` / nothing when it has no more proposals. Its stderr is passed through. It never
    prunes.

    Raises (from ``propose``):
        ProposerError: the command exited non-zero, timed out, or printed something other
            than a JSON object or null.
    """

    name = "command"

    def __init__(self, command: str, out_dir: Path, leaderboard: Path, space: dict, timeout_s: float = 600):
        self.argv = shlex.split(command)
        if not self.argv:
            raise ValueError("--proposer-command: empty command")
        self.out_dir, self.leaderboard, self.space, self.timeout_s = Path(out_dir), Path(leaderboard), space, timeout_s
        self.running = 0

    def propose(self) -> Proposal | None:
        env = {**os.environ, "AUTORESEARCH_LEADERBOARD": str(self.leaderboard.resolve()),
               "AUTORESEARCH_OUT": str(self.out_dir.resolve()), "AUTORESEARCH_SPACE": json.dumps(self.space),
               "AUTORESEARCH_RUNNING": str(self.running)}
        try:
            proc = subprocess.run(self.argv, env=env, stdout=subprocess.PIPE, stderr=sys.stderr, text=True,
                                  timeout=self.timeout_s)
        except subprocess.TimeoutExpired as e:
            raise ProposerError(f"proposer command timed out after {self.timeout_s} s: {self.argv}") from e
        except OSError as e:
            raise ProposerError(f"proposer command could not start: {e}") from e
        if proc.returncode != 0:
            raise ProposerError(f"proposer command exited {proc.returncode}: {self.argv}")
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        if not lines:
            return None
        try:
            cfg = json.loads(lines[-1])
        except json.JSONDecodeError as e:
            raise ProposerError(f"proposer command's last line is not JSON ({e}): {lines[-1][:200]!r}") from e
        if cfg is None:
            return None
        if not isinstance(cfg, dict):
            raise ProposerError(f"proposer command printed {type(cfg).__name__}, not a JSON object of config fields")
        self.running += 1
        return Proposal(cfg)

    def adopt(self, config: dict) -> Proposal:
        self.running += 1
        return Proposal(dict(config))

    def report(self, handle, step: int, reward: float) -> bool:
        return False

    def finish(self, handle, status: str, objective: float | None) -> None:
        self.running = max(0, self.running - 1)
