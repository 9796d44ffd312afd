"""Stop conditions for one sampled sequence (backends that decode token by token).

Semantics (the vLLM / Tinker ones, which the cookbook's renderers rely on):

* ``stop is None`` (a job's ``sampling_params.stop``): stop at the model's EOS ids.
* ``stop == []``: no stop at all, not even EOS; only ``max_tokens`` ends a sequence.
* ``stop`` = list of token ids: stop at any of them **or** at EOS. The stop token is the
  last token of the returned sequence (it is included, as vLLM's ``token_ids`` include it).
* ``stop`` = list of strings: stop as soon as the decoded text of the generated tokens
  (prompt excluded, special tokens skipped) contains one of them, **or** at EOS. The
  returned tokens end with the token that completed the stop string, so the stop string
  is part of ``tokenizer.decode(tokens)`` (tinker-cookbook's RoleColon renderer splits the
  decoded response on its ``"\\n\\nUser:"`` stop string and expects to find it). Nothing is
  trimmed: a token that completes the stop string and carries more text after it is kept
  whole.

A stop condition never fires on the prompt: only generated tokens are looked at.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def resolve_stop(
    stop: Sequence[str] | Sequence[int] | None, eos_ids: frozenset[int]
) -> tuple[frozenset[int], tuple[str, ...]]:
    """Turn a job's stop condition into (stop token ids, stop strings).

    Args:
        stop: the job's ``sampling_params.stop_list`` (validated: all str or all int).
        eos_ids: the model's EOS ids.

    Returns:
        ``(token_ids, strings)``; EOS is included unless ``stop == []``.
    """
    if stop is None:
        return frozenset(eos_ids), ()
    if len(stop) == 0:
        return frozenset(), ()
    if isinstance(stop[0], str):
        return frozenset(eos_ids), tuple(stop)  # type: ignore[arg-type]
    return frozenset(eos_ids) | frozenset(int(t) for t in stop), ()


class StopChecker:
    """Decides, after each generated token, whether a sequence has hit a stop condition.

    Stop strings are matched on a decoded tail window of the generated tokens, long
    enough to hold the longest stop string (a token decodes to at least one byte and a
    character is at most four bytes), so each check costs O(longest stop string), not
    O(sequence length). The check runs after every token, so the first token whose
    text completes a stop string is the one that stops the sequence.

    Args:
        token_ids: stop token ids (EOS included where it applies).
        strings: stop strings (non-empty).
        tokenizer: a Hugging Face tokenizer; required only when ``strings`` is non-empty.
    """

    def __init__(self, token_ids: frozenset[int], strings: Sequence[str], tokenizer: Any = None):
        self.token_ids = token_ids
        self.strings = tuple(strings)
        self.tokenizer = tokenizer
        if self.strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        longest = max((len(s.encode("utf-8")) for s in self.strings), default=0)
        # bytes of the longest stop string + slack for special tokens (decode to "") and
        # a partial UTF-8 character at the window's start.
        self.window = longest + 8

    def check(self, generated: Sequence[int]) -> bool:
        """True if the last token of ``generated`` (all generated tokens so far) stops it."""
        if not generated:
            return False
        if generated[-1] in self.token_ids:
            return True
        if not self.strings:
            return False
        tail = self.tokenizer.decode(
            list(generated[-self.window :]),
            skip_special_tokens=True,
            clean_up_tokenization_spaces=False,
        )
        return any(s in tail for s in self.strings)
