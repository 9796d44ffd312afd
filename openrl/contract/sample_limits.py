"""The limits of one sampling request that depend on the model or the service's caps.

:func:`check_sample_size` (the prompt, ``num_samples`` and ``max_tokens`` against the vocabulary,
the context and the caps) is the one size check both sides call: the gateway before it admits
and publishes a ``sample`` event (with the registry's vocabulary and context and the service's
caps), and the sampler's engine before it runs the job (with the loaded model's limits), so the
two accept and refuse the same requests with the same error. :func:`check_sample_limits` is
everything the engine checks against the loaded model: that size check, then the stop tokens,
the top-K widths, the last-N window and the target ids.

Static ranges (a temperature >= 0, a top_p in (0, 1], ...) are not here: they are field
constraints of the wire and payload models (``openrl.edge.wire``, :class:`openrl.contract.
payloads.Sample`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from openrl.errors import UserError

if TYPE_CHECKING:
    from openrl.contract.payloads import Sample


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
    if not _is_int(num_samples) or num_samples < 1:  # the text of Sample's field constraint
        raise UserError("num_samples", f"must be an integer >= 1, got {num_samples!r}")
    if num_samples > max_num_samples:
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


def check_sample_limits(job: Sample, *, vocab_size: int, max_context: int, has_tokenizer: bool,
                        max_num_samples: int, max_topk: int, max_tokens_cap: int | None = None,
                        default_max_tokens: int | None = None, prompt_field: str = "prompt.chunks") -> int:
    """Check a validated request against the model and the caps (what its field constraints cannot
    know), and return the ``max_tokens`` each sequence may generate.

    Args:
        job: a :class:`~openrl.contract.payloads.Sample` whose field constraints hold (made by
            ``Sample.parse``).
        vocab_size, max_context, max_num_samples, max_tokens_cap, default_max_tokens, prompt_field:
            as :func:`check_sample_size`.
        has_tokenizer: whether the model can honour stop strings.
        max_topk: most K for ``topk_prompt_logprobs``, ``topk_sample_logprobs``,
            ``prompt_alt_tokens_k`` and the width of ``target_prompt_logprobs``.

    Returns:
        As :func:`check_sample_size`.

    Raises:
        UserError: naming the field at fault: those of :func:`check_sample_size`;
            ``sampling_params.stop`` (a stop id outside the vocabulary, stop strings without a
            tokenizer); ``topk_prompt_logprobs`` / ``topk_sample_logprobs`` /
            ``prompt_alt_tokens_k`` (above ``max_topk``); ``prompt_logprobs_last_n`` (above
            P-1, or without ``prompt_logprobs``); ``target_prompt_logprobs`` (not P-1 rows of
            one width, no id, an id outside ``[-1, vocab_size)``, or wider than ``max_topk``).
    """
    sp = job.sampling_params
    prompt = job.prompt_tokens
    max_tokens = check_sample_size(prompt, job.num_samples, sp.max_tokens, vocab_size=vocab_size,
                                   max_context=max_context, max_num_samples=max_num_samples,
                                   max_tokens_cap=max_tokens_cap, default_max_tokens=default_max_tokens,
                                   prompt_field=prompt_field)
    P = len(prompt)
    stop = sp.stop_list
    if stop and isinstance(stop[0], str):
        if not has_tokenizer:
            raise UserError("sampling_params.stop", "this model has no tokenizer; use stop token ids")
    elif stop:
        bad = [s for s in stop if not 0 <= s < vocab_size]
        if bad:
            raise UserError("sampling_params.stop", f"stop token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        k = getattr(job, name)
        if k > max_topk:
            raise UserError(name, f"must be an integer in [0, {max_topk}], got {k!r}")
    n = job.prompt_logprobs_last_n
    if n is not None:
        if n > P - 1:
            raise UserError("prompt_logprobs_last_n", f"must be an integer in [1, len(prompt) - 1 = {P - 1}], got {n!r}")
        if not job.prompt_logprobs:
            raise UserError("prompt_logprobs_last_n", "needs prompt_logprobs (include_prompt_logprobs) set")
    tgt = job.target_prompt_ids
    if tgt is not None:
        if len(tgt) != P - 1:
            raise UserError("target_prompt_logprobs", f"must have exactly len(prompt) - 1 = {P - 1} rows")
        width = {len(r) for r in tgt}
        if len(width) > 1:
            raise UserError("target_prompt_logprobs", "rows must all have the same width")
        ids = [t for r in tgt for t in r]
        if not any(t != -1 for t in ids):
            raise UserError("target_prompt_logprobs", "must name at least one token id")
        if any(not -1 <= t < vocab_size for t in ids):
            raise UserError("target_prompt_logprobs", f"ids must be -1 or in [0, {vocab_size})")
        if width and next(iter(width)) > max_topk:
            raise UserError("target_prompt_logprobs", f"at most {max_topk} ids per row")
    return max_tokens


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


__all__ = ["check_sample_limits", "check_sample_size"]
