"""GRPO-style RL on arithmetic problems, with the public Tinker SDK only.

Each step: save the current weights and get a sampling client, sample a group of
answers per problem, reward each answer by parsing the number it gives, normalise the
rewards within each group (the advantages), and train with the ``importance_sampling``
loss using the sampler's logprobs.

    python examples/rl_loop.py --steps 10           # against $TINKER_BASE_URL
    openrl run examples/rl_loop.py -- --steps 10    # against a fresh embedded stack

The built offline model has random weights, so it starts by knowing nothing: an
optional supervised warm-up (``--warmup-steps``) teaches it the answer format first, so
that the RL steps see groups with differing rewards. With a real model set
``--warmup-steps 0``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import time
from pathlib import Path

import numpy as np
import tinker
from tinker import types
from tqdm import tqdm


def default_api_key() -> str | None:
    """$TINKER_API_KEY, else the embedded stack's generated key in $OPENRL_HOME/api_key."""
    if os.environ.get("TINKER_API_KEY"):
        return os.environ["TINKER_API_KEY"]
    f = Path(os.environ.get("OPENRL_HOME", Path.home() / ".openrl")) / "api_key"
    return f.read_text().strip() if f.exists() else None


def default_base_url() -> str:
    """$TINKER_BASE_URL, else the gateway of the ``openrl serve`` whose state dir is $OPENRL_HOME
    (its ``ports.json``, as ``openrl status`` reads it), else http://127.0.0.1:8000."""
    if os.environ.get("TINKER_BASE_URL"):
        return os.environ["TINKER_BASE_URL"]
    f = Path(os.environ.get("OPENRL_HOME", Path.home() / ".openrl")) / "ports.json"
    try:
        return json.loads(f.read_text())["gateway"]
    except (OSError, ValueError, KeyError, TypeError):
        return "http://127.0.0.1:8000"


_tokenizers: dict[str, object] = {}  # base model -> tokenizer, or the asyncio.Task loading it


async def shared_tokenizer(training, base_model: str):
    """``training.get_tokenizer()``, loaded once per base model however many runs ask at once.

    The load is synchronous (seconds for Qwen's tokenizer.json), so it runs in a thread; runs
    that ask while it loads await the same task. Loading it once per run instead, 8 runs
    starting together waited 19 s for their tokenizers on the H200 machine, against 9 s for
    one run alone (docs/benchmarks.md, the autoresearch sweep). A failed load is not kept:
    the next call tries again.

    Raises:
        whatever ``get_tokenizer`` raises (e.g. ``OSError`` for a tokenizer that cannot be found).
    """
    got = _tokenizers.get(base_model)
    loop = asyncio.get_running_loop()
    if got is None or isinstance(got, asyncio.Task) and got.get_loop() is not loop:
        got = _tokenizers[base_model] = loop.create_task(asyncio.to_thread(training.get_tokenizer))
    if not isinstance(got, asyncio.Task):
        return got
    try:
        tok = await asyncio.shield(got)
    except BaseException:
        if got.done() and _tokenizers.get(base_model) is got:
            del _tokenizers[base_model]
        raise
    _tokenizers[base_model] = tok
    return tok


def make_problems(n: int, rng: random.Random, max_operand: int) -> list[tuple[str, int]]:
    """``n`` addition problems ``("3+5=", 8)`` with operands in [0, max_operand]."""
    out = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append((f"{a}+{b}=", a + b))
    return out


def reward(text: str, answer: int) -> float:
    """1.0 if the first integer in ``text`` equals ``answer``; 0.1 if it gives some integer; else 0."""
    m = re.search(r"-?\d+", text)
    if m is None:
        return 0.0
    return 1.0 if int(m.group()) == answer else 0.1


def group_advantages(rewards: list[float]) -> list[float]:
    """GRPO advantages: reward minus the group mean, divided by the group std (+1e-6)."""
    r = np.asarray(rewards, dtype=np.float64)
    return list((r - r.mean()) / (r.std() + 1e-6))


def sft_datum(tokenizer, prompt: str, completion: str) -> types.Datum:
    """Next-token datum: loss on the completion tokens only (weights 0 on the prompt)."""
    p = tokenizer.encode(prompt, add_special_tokens=False)
    c = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    toks = p + c
    weights = [0.0] * (len(p) - 1) + [1.0] * len(c)
    return types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:], "weights": weights},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=default_base_url())
    ap.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--problems", type=int, default=4, help="problems per step")
    ap.add_argument("--group", type=int, default=4, help="samples per problem")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--max-operand", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (1e-2 suits the tiny built model; ~1e-4 for a real one)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--warmup-steps", type=int, default=40, help="supervised steps before RL (0 for a real model)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    service = tinker.ServiceClient(base_url=args.base_url, api_key=default_api_key())
    training = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=args.seed).result()
    tokenizer = training.get_tokenizer()
    adam = types.AdamParams(learning_rate=args.lr)
    print(f"training run {training.model_id} on {args.model}")

    if args.warmup_steps:
        pool = make_problems(32, random.Random(args.seed + 1), args.max_operand)
        bar = tqdm(range(args.warmup_steps), desc="warm-up (SFT)")
        for _ in bar:
            batch = [sft_datum(tokenizer, q, f" {a}") for q, a in rng.sample(pool, 8)]
            fb = training.forward_backward(batch, "cross_entropy")
            training.optim_step(adam).result()
            bar.set_postfix(loss=f"{fb.result().metrics['loss:sum']:.2f}")

    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=["\n"])
    bar = tqdm(range(args.steps), desc="RL")
    for step in bar:
        t0 = time.time()
        sampler = training.save_weights_and_get_sampling_client().result()
        problems = make_problems(args.problems, rng, args.max_operand)
        futures = []
        for q, a in problems:
            prompt = types.ModelInput.from_ints(tokenizer.encode(q, add_special_tokens=False))
            futures.append((prompt, a, sampler.sample(prompt, num_samples=args.group, sampling_params=params)))
        data, rewards_all = [], []
        for prompt, a, fut in futures:
            seqs = fut.result().sequences
            rewards = [reward(tokenizer.decode(s.tokens), a) for s in seqs]
            rewards_all += rewards
            for s, adv in zip(seqs, group_advantages(rewards)):
                if not s.tokens:
                    continue
                toks = prompt.to_ints() + list(s.tokens)
                n_prompt = prompt.length
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={
                        "target_tokens": toks[1:],
                        "logprobs": [0.0] * (n_prompt - 1) + list(s.logprobs),
                        "advantages": [0.0] * (n_prompt - 1) + [adv] * len(s.tokens),
                    },
                ))
        fb = training.forward_backward(data, "importance_sampling")
        training.optim_step(adam).result()
        loss = fb.result().metrics["loss:sum"]
        mean_r = float(np.mean(rewards_all))
        bar.set_postfix(reward=f"{mean_r:.2f}", loss=f"{loss:.3f}")
        tqdm.write(f"step {step}: mean_reward={mean_r:.3f} loss:sum={loss:.4f} "
                   f"samples={len(rewards_all)} step_s={time.time() - t0:.1f}")
    service.close("success").result(timeout=30)  # finish the session before the interpreter exits
    print("done")


if __name__ == "__main__":
    main()
