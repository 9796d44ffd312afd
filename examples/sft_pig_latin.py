"""Supervised fine-tuning on English → Pig Latin pairs, with the public Tinker SDK only.

The pairs are made by rule from the word list shipped beside this file
(``examples/data/english_words.txt``): a word starting with a vowel gets "way"
appended; otherwise its leading consonant cluster moves to the end, followed by "ay"
("banana" → "ananabay", "string" → "ingstray").

    python examples/sft_pig_latin.py --steps 20
    openrl run examples/sft_pig_latin.py -- --steps 20
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import tinker
from tinker import types
from tqdm import tqdm

VOWELS = set("aeiou")
WORDS = Path(__file__).parent / "data" / "english_words.txt"


def default_api_key() -> str | None:
    """$TINKER_API_KEY, else the embedded stack's generated key in $OPENRL_HOME/api_key."""
    if os.environ.get("TINKER_API_KEY"):
        return os.environ["TINKER_API_KEY"]
    f = Path(os.environ.get("OPENRL_HOME", Path.home() / ".openrl")) / "api_key"
    return f.read_text().strip() if f.exists() else None


def pig_latin(word: str) -> str:
    """The Pig Latin form of one lower-case English word (rule in the module docstring)."""
    if word[0] in VOWELS:
        return word + "way"
    i = 0
    while i < len(word) and word[i] not in VOWELS and not (i > 0 and word[i] == "y"):
        i += 1
    return word[i:] + word[:i] + "ay"


def make_datum(tokenizer, english: str) -> types.Datum:
    """Prompt ``English: <w>\\nPig Latin:`` with loss on the answer tokens (+ EOS) only."""
    prompt = tokenizer.encode(f"English: {english}\nPig Latin:", add_special_tokens=False)
    answer = tokenizer.encode(f" {pig_latin(english)}", add_special_tokens=False) + [tokenizer.eos_token_id]
    toks = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": toks[1:], "weights": weights})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"))
    ap.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    words = WORDS.read_text().split()
    rng = random.Random(args.seed)
    rng.shuffle(words)
    train, test = words[:-8], words[-8:]

    service = tinker.ServiceClient(base_url=args.base_url, api_key=default_api_key())
    training = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=args.seed).result()
    tok = training.get_tokenizer()
    adam = types.AdamParams(learning_rate=args.lr)
    bar = tqdm(range(args.steps), desc="SFT pig latin")
    for step in bar:
        t0 = time.time()
        batch = [make_datum(tok, w) for w in rng.sample(train, args.batch)]
        fb = training.forward_backward(batch, "cross_entropy")
        training.optim_step(adam).result()
        m = fb.result().metrics
        ntok = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
        bar.set_postfix(loss_per_token=f"{m['loss:sum'] / ntok:.3f}")
        tqdm.write(f"step {step}: loss:sum={m['loss:sum']:.3f} per_token={m['loss:sum'] / ntok:.3f} "
                   f"step_s={time.time() - t0:.2f}")

    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=8, temperature=0.0)
    for w in test[:4]:
        prompt = types.ModelInput.from_ints(tok.encode(f"English: {w}\nPig Latin:", add_special_tokens=False))
        out = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
        print(f"{w!r:>14} -> {tok.decode(out.tokens, skip_special_tokens=True).strip()!r} (rule: {pig_latin(w)!r})")


if __name__ == "__main__":
    main()
