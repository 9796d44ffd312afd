"""Helpers both sampler backends share: per-sample seeds, the tokenizer, EOS id sets, idle sleep of several parts."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Files whose presence in a model directory means it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def row_seed(seed: int, index: int) -> int:
    """63-bit generator seed of sample ``index`` of a job seeded with ``seed``.

    A hash of ``(seed, index)`` only, so it is stable across processes and batches (both
    backends use it: the same seed draws the same samples whatever else is batched).
    """
    digest = hashlib.sha256(f"openrl-sampler:{int(seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def has_tokenizer_files(directory: Path) -> bool:
    """Whether ``directory`` holds any of :data:`TOKENIZER_FILES`."""
    return any((Path(directory) / n).is_file() for n in TOKENIZER_FILES)


def load_tokenizer(directory: Path) -> Any:
    """The transformers tokenizer of a model directory, or None when it has none or it is
    unusable (a warning is logged; the model still samples, without stop strings)."""
    directory = Path(directory)
    if not has_tokenizer_files(directory):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory))
    except Exception:  # a model without a usable tokenizer still samples (no stop strings)
        log.warning("no usable tokenizer in %s; stop strings are disabled", directory, exc_info=True)
        return None


def token_ids(x: Any) -> set[int]:
    """A config's ``eos_token_id`` (None, an int or a list of ints) as a set of ints."""
    if x is None:
        return set()
    if isinstance(x, int):
        return {x}
    return {int(i) for i in x}


async def sleep_together(parts: list[Any]) -> bool:
    """Idle sleep of several parts (backends, engines) as one: each ``sleep()`` in turn; when one
    declines (returns False) or raises, the parts already asleep are woken again, so all stay in
    one state. True when every part sleeps.

    Raises:
        ServerError: a part without ``sleep()`` (named), or what a part's ``sleep()`` raised.
    """
    from openrl.errors import ServerError

    done: list[Any] = []
    try:
        for part in parts:
            fn = getattr(part, "sleep", None)
            if not callable(fn):
                raise ServerError(f"the {getattr(part, 'name', type(part).__name__)} sampler backend cannot sleep")
            if await fn() is False:
                break
            done.append(part)
        else:
            return True
    except BaseException:
        for d in done:
            await d.wake()
        raise
    for d in done:
        await d.wake()
    return False
