"""The tasks an experiment can train on, and the registry of reward variants per task.

A reward variant is named ``"<task>/<variant>"`` (e.g. ``"arithmetic/shaped"``); the task
part picks the prompts, the variant the function that scores one sampled completion.

* ``arithmetic``: ``"a+b="`` problems of ``examples/rl_loop.py`` (operands 0..4).
* ``text_to_sql``: questions of ``examples/text_to_sql`` against its generated SQLite shop
  database (real data: template questions with gold SQL, executed read-only).

Rewards are floats in [0, 1].
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rl_loop import make_problems
from rl_loop import reward as rl_loop_reward

MAX_OPERAND = 4


@dataclass
class Problem:
    """One prompt of a task: its token ids and what the reward needs to score an answer."""

    prompt_tokens: list[int]
    answer: Any  # arithmetic: the int sum; text_to_sql: the text_to_sql.Example


# ------------------------------------------------------------------ reward functions
# Each takes (completion text, problem answer, task context) and returns a float in [0, 1].

def _first_int(text: str) -> int | None:
    m = re.search(r"-?\d+", text)
    return None if m is None else int(m.group())


def arithmetic_exact(text: str, answer: int, ctx: "TaskContext") -> float:
    """1.0 if the first integer in the text is the sum, else 0.0."""
    return 1.0 if _first_int(text) == answer else 0.0


def arithmetic_shaped(text: str, answer: int, ctx: "TaskContext") -> float:
    """examples/rl_loop.py's reward: 1.0 right, 0.1 for some integer, 0.0 for none."""
    return rl_loop_reward(text, answer)


def arithmetic_distance(text: str, answer: int, ctx: "TaskContext") -> float:
    """``max(0, 1 - |x - answer| / (2 * MAX_OPERAND + 1))`` for the first integer x; 0.0 for none."""
    x = _first_int(text)
    if x is None:
        return 0.0
    return max(0.0, 1.0 - abs(x - answer) / (2 * MAX_OPERAND + 1))


def sql_exec_match(text: str, example, ctx: "TaskContext") -> float:
    """1.0 when the extracted SQL's result set equals the gold query's (examples/text_to_sql/env.py)."""
    return ctx.sql_env().reward(text, example)[0]


def sql_exec_partial(text: str, example, ctx: "TaskContext") -> float:
    """1.0 for a matching result set, 0.2 for SQL that runs but gives another result, 0.0 otherwise."""
    r, res = ctx.sql_env().reward(text, example)
    return 1.0 if r == 1.0 else (0.2 if res.ok else 0.0)


REWARDS: dict[str, Callable[[str, Any, "TaskContext"], float]] = {
    "arithmetic/exact": arithmetic_exact,
    "arithmetic/shaped": arithmetic_shaped,
    "arithmetic/distance": arithmetic_distance,
    "text_to_sql/exec_match": sql_exec_match,
    "text_to_sql/exec_partial": sql_exec_partial,
}


# ------------------------------------------------------------------ tasks

class TaskContext:
    """Per-driver state the tasks share: the SQLite database file (built on first use in
    ``workdir``) and the text-to-SQL question split (loaded once)."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self._env = None
        self._train = None

    def sql_env(self):
        if self._env is None:
            from text_to_sql import SQLEnv, build_database

            self.workdir.mkdir(parents=True, exist_ok=True)
            self._env = SQLEnv(build_database(self.workdir / "shop.db"))
        return self._env

    def sql_train(self):
        if self._train is None:
            from text_to_sql import make_examples, split_examples

            self._train = split_examples(make_examples())[0]
        return self._train


def task_of(reward: str) -> str:
    """The task part of a reward variant name.

    Raises:
        ValueError: the name is not in :data:`REWARDS`.
    """
    if reward not in REWARDS:
        raise ValueError(f"reward: unknown variant {reward!r}; known: {', '.join(REWARDS)}")
    return reward.split("/", 1)[0]


def stop_tokens(task: str, tokenizer) -> list:
    """Sampling stop sequences: a newline for arithmetic, the end-of-turn token for SQL."""
    if task == "arithmetic":
        return ["\n"]
    from text_to_sql.prompts import end_of_turn_id

    return [end_of_turn_id(tokenizer)]


def problems(task: str, n: int, rng: random.Random, tokenizer, ctx: TaskContext) -> list[Problem]:
    """``n`` prompts of ``task`` drawn with ``rng`` (tokenised with the run's tokenizer)."""
    if task == "arithmetic":
        return [Problem(tokenizer.encode(q, add_special_tokens=False), a) for q, a in make_problems(n, rng, MAX_OPERAND)]
    if task == "text_to_sql":
        from text_to_sql.prompts import prompt_tokens

        return [Problem(prompt_tokens(tokenizer, e.question), e) for e in rng.sample(ctx.sql_train(), n)]
    raise ValueError(f"task: unknown task {task!r}")
