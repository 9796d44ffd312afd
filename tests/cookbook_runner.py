"""Run one tinker-cookbook recipe module, unmodified, offline: ``python cookbook_runner.py
MODULE [chz args...]`` (e.g. ``tinker_cookbook.recipes.sl_basic max_steps=2``).

The recipe's code runs as ``python -m MODULE ARGS`` would run it; the SDK talks to
``$TINKER_BASE_URL`` with ``$TINKER_API_KEY``. Two things cannot be had offline and are
stood in for here, and only these:

* **Hugging Face datasets.** ``datasets.load_dataset`` is replaced (before any recipe module
  is imported) by :func:`offline_load_dataset`, which builds small in-memory datasets with the
  real column layout for the datasets the basic recipes read: ``HuggingFaceH4/no_robots``
  (``messages`` chat turns, train/test) and ``openai/gsm8k`` config ``main`` (``question``,
  ``answer`` ending in ``#### <number>``). Any other dataset raises, naming itself.
* **The recipe model's tokenizer.** When ``$OPENRL_TOKENIZER_STANDIN`` names a model directory
  and ``$OPENRL_TOKENIZER_NAMES`` a comma-separated list of Hub repo ids, the directory's
  tokenizer files are laid into the Hugging Face Hub cache (``$HF_HOME/hub``) under those ids,
  exactly as ``from_pretrained`` would have cached them, so ``AutoTokenizer.from_pretrained
  (repo_id)`` works with ``HF_HUB_OFFLINE=1``. The stand-in is the offline model's (Qwen3)
  tokenizer, which is also what the server's model uses.
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json", "config.json")
STANDIN_REVISION = "0" * 40


def seed_hub_cache(model_dir: Path, repo_ids: list[str], hub_dir: Path) -> None:
    """Lay ``model_dir``'s tokenizer files into the HF Hub cache as snapshot ``000..0`` of each repo id."""
    for repo in repo_ids:
        base = hub_dir / ("models--" + repo.replace("/", "--"))
        snap = base / "snapshots" / STANDIN_REVISION
        snap.mkdir(parents=True, exist_ok=True)
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / "main").write_text(STANDIN_REVISION)
        for name in TOKENIZER_FILES:
            if (model_dir / name).exists() and not (snap / name).exists():
                shutil.copy(model_dir / name, snap / name)


def _no_robots(split: str, n: int):
    rows = []
    for i in range(n):
        a, b = 3 + i, 4 + 2 * i
        rows.append({"prompt": f"What is {a} plus {b}?", "prompt_id": f"{split}-{i}", "category": "Open QA",
                     "messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]})
    return rows


def _gsm8k(split: str, n: int):
    rows = []
    for i in range(n):
        a, b = 2 + i, 5 + 3 * i
        rows.append({"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                     "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"})
    return rows


STANDINS = {"HuggingFaceH4/no_robots": _no_robots, "openai/gsm8k": _gsm8k}


def offline_load_dataset(path, name=None, split=None, **kwargs):
    """Stand-in for ``datasets.load_dataset``: the datasets in :data:`STANDINS`, 256 train and
    16 test rows each (sl_basic's fixed batch of 128 gives 2 steps), as a ``DatasetDict`` (or one ``Dataset`` when ``split`` is given).

    Raises:
        RuntimeError: any other dataset (it would need the Hugging Face Hub).
    """
    import datasets

    make = STANDINS.get(path)
    if make is None:
        raise RuntimeError(f"cookbook_runner: no offline stand-in for dataset {path!r} (config {name!r})")
    dd = datasets.DatasetDict({s: datasets.Dataset.from_list(make(s, 256 if s == "train" else 16))
                               for s in ("train", "test")})
    return dd[split] if split else dd


def main(argv: list[str]) -> None:
    module, args = argv[0], argv[1:]
    standin = os.environ.get("OPENRL_TOKENIZER_STANDIN")
    if standin:
        hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
        seed_hub_cache(Path(standin), [n for n in os.environ.get("OPENRL_TOKENIZER_NAMES", "").split(",") if n], hub)
    import datasets

    datasets.load_dataset = offline_load_dataset
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
