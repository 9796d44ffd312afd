"""The size limits of one sampling request, checked by one function that both sides call: the
gateway before it admits and publishes a ``sample`` event (with the registry's vocabulary and
context and the service's caps), and the sampler's engine before it runs the job (with the
loaded model's limits). The two then accept and refuse the same requests with the same error.

Other checks stay where their knowledge is: sampling parameters' ranges are field constraints of
the wire and payload models (``openrl.edge.wire``, ``openrl.contract.payloads``); what needs the
loaded model's tokenizer or EOS ids (stop strings) is the engine's.
"""

from __future__ import annotations

from typing import Sequence

from openrl.errors import UserError


def check_sample_size(prompt: Sequence[int], num_samples: object, max_tokens: object, *, vocab_size: int,
                      max_context: int, max_num_samples: int, max_tokens_cap: int | None = None,
                      default_max_tokens: int | None = None, prompt_field: str = "prompt") -> int:
    """Check a request's prompt, ``num_samples`` and ``max_tokens`` against the model and the
    caps, and return the ``max_tokens`` each sequence may generate.

    Args:
        prompt: the prompt's token ids (P of them, the chunks concatenated).
        num_samples: sequences asked for.
        max_tokens: ``sampling_params.max_tokens``; None = as many as the caps allow.
        vocab_size: valid ids are ``0 <= id < vocab_size``.
        max_context: most tokens (prompt + generated) in one sequence.
        max_num_samples: most sequences per request.
        max_tokens_cap: most ``max_tokens`` a request may ask for (the gateway's
            ``OPENRL_SAMPLER_MAX_TOKENS_CAP``); None = only the context bounds it.
        default_max_tokens: the cap on an omitted ``max_tokens`` (None: ``max_tokens_cap``,
            else the room left in the context).
        prompt_field: the field named for a prompt that is empty or leaves no room: the
            gateway's ``prompt`` (the request's ModelInput); the sampler's engine keeps
            ``prompt.chunks`` for direct callers of ``SamplerEngine``.

    Returns:
        ``max_tokens`` if given, else ``min(default, max_context - P)``, >= 1.

    Raises:
        UserError: ``prompt_field`` (empty, or no room left in the context), ``prompt.chunks``
            (an id outside the vocabulary), ``num_samples`` (not an integer in [1, max_num_samples]),
            ``sampling_params.max_tokens`` (not an integer >= 1, above the cap, or prompt +
            max_tokens over the context).
    """
    if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
        raise UserError(prompt_field, "the prompt must hold at least one token")
    for t in prompt:
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise UserError("prompt.chunks", f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
    P = len(prompt)
    if P >= max_context:
        raise UserError(prompt_field, f"the prompt has {P} tokens; the model context is {max_context} tokens, "
                        "which leaves no room to generate")
    if not _is_int(num_samples) or not 1 <= num_samples <= max_num_samples:
        raise UserError("num_samples", f"must be an integer in [1, {max_num_samples}], got {num_samples!r}")
    room = max_context - P
    if max_tokens is None:
        default = default_max_tokens if default_max_tokens is not None else max_tokens_cap
        return room if default is None else min(int(default), room)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise UserError("sampling_params.max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
    if max_tokens_cap is not None and max_tokens > max_tokens_cap:
        raise UserError("sampling_params.max_tokens", f"must be between 1 and {max_tokens_cap}, got {max_tokens}")
    if max_tokens > room:
        raise UserError("sampling_params.max_tokens", f"prompt ({P} tokens) + max_tokens ({max_tokens}) exceeds "
                        f"the model context of {max_context} tokens")
    return int(max_tokens)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


__all__ = ["check_sample_size"]
