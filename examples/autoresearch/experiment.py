"""One experiment: a config, and the RL loop that runs it through the tinker SDK.

The loop is examples/rl_loop.py's (sample a group per prompt from the current weights,
reward each completion, GRPO advantages = group-normalised rewards, one
``forward_backward`` + ``optim_step`` per step) with the loss, rank, group size, learning
rate and reward variant taken from the config.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Callable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tinker import types

from rl_loop import group_advantages, shared_tokenizer

from . import tasks

Loss = Literal["importance_sampling", "ppo", "cispo", "dro", "stable_reinforce"]


class ExperimentConfig(BaseModel):
    """What one experiment trains with. Unknown keys are refused (a typo in a proposal fails
    with the field's name instead of silently running the defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    learning_rate: float = Field(1e-2, gt=0, le=1.0, description="Adam learning rate")
    rank: int = Field(8, ge=1, le=256, description="LoRA rank")
    loss: Loss = "importance_sampling"
    group_size: int = Field(4, ge=2, le=64, description="samples per prompt (the GRPO group)")
    reward: str = Field("arithmetic/shaped", description="a variant of tasks.REWARDS")
    prompts: int = Field(2, ge=1, le=256, description="prompts per step")
    max_tokens: int = Field(6, ge=1, le=4096)
    temperature: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0, description="supervised steps (arithmetic only) before RL")
    seed: int = 0

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, v: str) -> str:
        tasks.task_of(v)  # raises ValueError naming the known variants
        return v


class Pruned(Exception):
    """Raised by an ``on_step`` callback to stop an experiment early (the proposer pruned it)."""


class StopRequested(Exception):
    """Raised by an ``on_step`` callback when the sweep's time budget is spent."""


def rl_datum(prompt: list[int], seq, advantage: float, with_spans: bool) -> types.Datum:
    """The RL datum of one sampled sequence: input ``prompt + tokens[:-1]``, targets shifted
    by one, sampler logprobs and the advantage on the sampled positions (0 on the prompt).
    With ``with_spans`` it also names where each position came from (provenance spans, which
    ``stable_reinforce`` needs to find the recorded sampler logprobs)."""
    toks = prompt + list(seq.tokens)
    n, m = len(prompt), len(seq.tokens)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:],
                        "logprobs": [0.0] * (n - 1) + list(seq.logprobs),
                        "advantages": [0.0] * (n - 1) + [float(advantage)] * m})
    if not with_spans:
        return datum
    sid = seq.sequence_id
    inp = [types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=n)]
    if m > 1:
        inp.append(types.SampledProvenanceSpan(sequence_id=sid, length=m - 1))
    tgt = [types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n - 1)] if n > 1 else []
    tgt.append(types.SampledProvenanceSpan(sequence_id=sid, length=m))
    return datum.with_provenance(model_input=inp, loss_fn_inputs=tgt)


async def run_experiment(service, base_model: str, cfg: ExperimentConfig, steps: int, ctx: tasks.TaskContext,
                         on_step: Callable[[dict], None]) -> list[dict]:
    """Run ``steps`` RL steps of ``cfg``; call ``on_step(record)`` after each step.

    ``record`` is ``{"step", "reward" (mean over the step's samples, [0, 1]), "loss"
    (loss:sum, or None when every sample was empty), "seconds"}``. ``on_step`` may raise
    :class:`Pruned` or :class:`StopRequested`, which propagate to the caller after the
    step's update has finished.

    Raises:
        tinker.APIError (and subclasses): the service failed a request.
    """
    task = tasks.task_of(cfg.reward)
    rng = random.Random(cfg.seed)
    training = await service.create_lora_training_client(base_model=base_model, rank=cfg.rank, seed=cfg.seed)
    # The tokenizer loads (seconds of client CPU, once per driver) while the first weights are saved.
    tok_load = asyncio.ensure_future(shared_tokenizer(training, base_model))
    try:
        return await _rl_steps(training, tok_load, task, rng, cfg, steps, ctx, on_step)
    finally:
        tok_load.cancel()  # a no-op once loaded; else only this wait ends, the shared load goes on (shielded)


async def _rl_steps(training, tok_load: asyncio.Future, task: str, rng: random.Random, cfg: ExperimentConfig,
                    steps: int, ctx: tasks.TaskContext, on_step: Callable[[dict], None]) -> list[dict]:
    """run_experiment's warm-up and RL steps, given its training client and the tokenizer's load."""
    score = tasks.REWARDS[cfg.reward]
    adam = types.AdamParams(learning_rate=cfg.learning_rate)
    if cfg.warmup_steps and task == "arithmetic":
        from rl_loop import sft_datum

        tok = await tok_load
        pool = tasks.make_problems(32, random.Random(cfg.seed + 1), tasks.MAX_OPERAND)
        for _ in range(cfg.warmup_steps):
            fb = training.forward_backward([sft_datum(tok, q, f" {a}") for q, a in rng.sample(pool, 8)], "cross_entropy")
            opt = training.optim_step(adam)
            await fb
            await opt
    spans = cfg.loss == "stable_reinforce"
    records = []
    for step in range(steps):
        t0 = time.perf_counter()
        sampler = await training.save_weights_and_get_sampling_client(record_stability_info=spans)
        t_tok = time.perf_counter()
        tok = await tok_load
        tok_wait = time.perf_counter() - t_tok  # not the step's own time (step 0 only; then it is loaded)
        params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                      stop=tasks.stop_tokens(task, tok))
        batch = tasks.problems(task, cfg.prompts, rng, tok, ctx)
        results = await asyncio.gather(*(
            sampler.sample(types.ModelInput.from_ints(p.prompt_tokens), num_samples=cfg.group_size,
                           sampling_params=params).result_async() for p in batch))
        data, rewards_all = [], []
        for p, res in zip(batch, results):
            rewards = [score(tok.decode(s.tokens, skip_special_tokens=True), p.answer, ctx) for s in res.sequences]
            rewards_all += rewards
            for s, adv in zip(res.sequences, group_advantages(rewards)):
                if s.tokens:
                    data.append(rl_datum(p.prompt_tokens, s, adv, spans))
        loss = None
        if data:
            fb = training.forward_backward(data, cfg.loss)
            opt = training.optim_step(adam)
            loss = float((await fb).metrics["loss:sum"])
            await opt
        mean_r = float(np.mean(rewards_all))
        if not math.isfinite(mean_r):
            raise RuntimeError(f"step {step}: non-finite mean reward {mean_r}")
        rec = {"step": step, "reward": mean_r, "loss": loss, "seconds": round(time.perf_counter() - t0 - tok_wait, 3)}
        records.append(rec)
        on_step(rec)
    return records
