"""Generated stand-in data for the tinker-cookbook recipes that ``tests/stack/test_cookbook_recipes.py``
runs unmodified, and the runner that launches them: ``python recipe_standins.py MODULE [chz args...]``.

The recipe code is not touched. What it would download from the Hugging Face Hub is replaced by
small generated data with the real layout, and only that:

* ``datasets.load_dataset`` is :func:`cookbook_runner.offline_load_dataset` (``HuggingFaceH4/no_robots``,
  ``openai/gsm8k``) plus, registered here, ``Anthropic/hh-rlhf`` (``chosen`` / ``rejected``
  transcripts in the ``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` form that differ only in the last
  assistant turn), for the DPO recipe's ``dataset=hhh``;
* :func:`write_prophet_arena_csv` writes a Prophet Arena CSV (the decisions forecasting recipe's
  data, normally fetched from the Hub) with the recipe's required columns, which the test passes
  through the recipe's own ``data_path`` option.

The tokenizer stand-in (the offline model's Qwen3 tokenizer laid into a private Hub cache) is
``cookbook_runner``'s. :func:`write_boxed_answer_model` writes a stand-in *model* for
``rl_loop``, whose reward needs a ``\\boxed{N}`` answer that a random model never writes.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cookbook_runner  # noqa: E402


def _hh_rlhf(split: str, n: int) -> list[dict]:
    """``Anthropic/hh-rlhf`` rows: one human turn, the chosen answer right, the rejected wrong."""
    rows = []
    for i in range(n):
        a, b = 2 + i, 3 + 2 * i
        prompt = f"\n\nHuman: What is {a} times {b}?"
        rows.append({"chosen": f"{prompt}\n\nAssistant: {a} times {b} is {a * b}.",
                     "rejected": f"{prompt}\n\nAssistant: I would rather not say."})
    return rows


def _gsm8k_four_or_five(split: str, n: int) -> list[dict]:
    """``openai/gsm8k`` rows (``question``, ``answer`` ending ``#### N``) whose answers are 4 or 5,
    alternating: the two answers :func:`write_boxed_answer_model`'s model gives."""
    rows = []
    for i in range(n):
        total, a = 4 + i % 2, 1 + i % 3
        rows.append({"question": f"Tom has {a} apples and buys {total - a} more. How many apples does he have?",
                     "answer": f"He has {a} + {total - a} = <<{a}+{total - a}={total}>>{total} apples.\n#### {total}"})
    return rows


cookbook_runner.STANDINS["Anthropic/hh-rlhf"] = _hh_rlhf
cookbook_runner.STANDINS["openai/gsm8k"] = _gsm8k_four_or_five

PROPHET_COLUMNS = ("submission_id", "event_ticker", "title", "snapshot_time", "close_time", "market_outcome",
                   "category", "markets", "sources")


def write_prophet_arena_csv(path: Path, n_train_events: int, n_validation_events: int,
                            split_date: str = "2025-10-20") -> Path:
    """Write a stand-in Prophet Arena CSV: binary markets, two per event, events closing before
    ``split_date`` (training) and events opening after it (validation), outcomes alternating.

    Args:
        path: the CSV file to write.
        n_train_events, n_validation_events: events on each side of the temporal split.
        split_date: the recipe's ``split_date`` (its default, 2025-10-20).

    Returns:
        ``path``.
    """
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=PROPHET_COLUMNS)
        w.writeheader()
        for i in range(n_train_events + n_validation_events):
            train = i < n_train_events
            month, close_month = ("2025-08", "2025-09") if train else ("2025-11", "2025-12")
            markets = [f"Team {i} wins game {g}" for g in (1, 2)]
            w.writerow({
                "submission_id": f"sub-{i}", "event_ticker": f"EV{i}", "title": f"Stand-in event {i}",
                "snapshot_time": f"{month}-{1 + i % 20:02d}T12:00:00Z",
                "close_time": f"{close_month}-{1 + i % 20:02d}T12:00:00Z",
                "market_outcome": json.dumps({m: (i + g) % 2 for g, m in enumerate(markets)}),
                "category": "Sports", "markets": json.dumps(markets),
                "sources": json.dumps([{"title": f"Preview {i}", "summary": f"Team {i} has won {i % 5} of 5.",
                                        "ranking": 1}]),
            })
    return path


def write_boxed_answer_model(tiny_dir: Path, out: Path, answers: tuple[str, ...] = ("4", "5")) -> Path:
    """Write a copy of the offline tiny Qwen3 model (``tiny_dir``) that answers a role_colon
    prompt (ending ``Assistant:``) with `` \\boxed{A}\\n\\nUser:``, ``A`` drawn uniformly from
    ``answers`` (each one token), at any temperature near 1.

    How: attention and MLP outputs are zeroed (``o_proj``, ``down_proj``), so the last hidden
    state is the current token's embedding; the chain tokens get one-hot embeddings (slot i of
    the 64-d hidden state), the output head is untied, and its row for token b is 5 x the sum of
    the one-hots of the tokens it follows: after RMSNorm (one-hot -> 8 x one-hot) the next chain
    token gets logit 40 and every other token 0, a bigram model. Only the weights change; the
    architecture, tokenizer and config (but ``tie_word_embeddings``) are the tiny model's.

    Returns:
        ``out``, a Hugging Face model directory (safetensors, float32).
    """
    import safetensors.torch as st
    import torch
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    for f in tiny_dir.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "openrl-build.json"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    head = enc("Assistant:")[-1:] + enc(" \\boxed{")  # ':' ' \\' 'boxed' '{'
    tail = enc("}\n\nUser:")  # '}\n\n' 'User' ':'
    digits = [enc(a) for a in answers]
    assert all(len(d) == 1 for d in digits), digits
    edges = list(zip(head, head[1:])) + [(head[-1], d[0]) for d in digits] + [(d[0], tail[0]) for d in digits] \
        + list(zip(tail, tail[1:]))
    w = st.load_file(str(tiny_dir / "model.safetensors"))
    hidden = cfg["hidden_size"]
    slots = {t: i for i, t in enumerate(dict.fromkeys([a for a, _ in edges]))}
    assert len(slots) <= hidden
    emb = w["model.embed_tokens.weight"].clone()
    lm_head = torch.zeros_like(emb)
    for t, i in slots.items():
        emb[t] = 0.0
        emb[t, i] = 1.0
    for a, b in edges:
        lm_head[b, slots[a]] += 5.0
    w["model.embed_tokens.weight"] = emb
    w["lm_head.weight"] = lm_head
    w["model.norm.weight"] = torch.ones(hidden)
    for k in list(w):
        if k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            w[k] = torch.zeros_like(w[k])
    st.save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    cookbook_runner.main(sys.argv[1:])
