"""The vLLM backend's CPU-side conversions (no vLLM import): trainer adapters to vLLM-ready
PEFT directories checked, a job (:class:`openrl.contract.payloads.Sample`) to ``vllm.SamplingParams``
keyword arguments, vLLM outputs to ``SampleResult`` fields, and the model limits read from
``config.json``.

vLLM computes the logprobs itself, in its engine core (``logprobs_mode="raw_logprobs"``, its
default): ``log_softmax`` of the raw float32 logits, the formula of
``openrl.model.logprobs.logprobs_from_logits``; here they are only read out.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from functions.sampler.types import (
    TOPK_MASK_LOGPROB,
    ModelLimits,
    SampledSequence,
    SampleResult,
)
from openrl.contract.payloads import Sample
from openrl.errors import ServerError, UserError
from openrl.model.lora import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, UNEMBED_TARGET

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- adapters


def prepare_adapter(src: Path, *, max_rank: int | None = None) -> dict:
    """Check that a PEFT adapter directory is one vLLM can load whole, and describe it.

    Nothing is converted: vLLM reads the trainer's export as it is, the unembedding
    (``lm_head``) LoRA included (vLLM wraps the logits processor in
    ``LogitsProcessorWithLoRA``, also when ``lm_head`` is tied to the input embedding).

    Args:
        src: directory with ``adapter_model.safetensors`` + ``adapter_config.json`` (the
            trainer's export: float32 ``base_model.model.<path>.lora_{A,B}.weight``).
        max_rank: the engine's ``max_lora_rank``; a larger ``r`` is a ``UserError``.

    Returns:
        ``{"rank", "alpha", "targets", "unembed": whether it adapts lm_head}``.

    Raises:
        UserError("model_path", ...): files missing/unreadable, or rank too large.
    """
    src = Path(src)
    wpath, cpath = src / ADAPTER_WEIGHTS_NAME, src / ADAPTER_CONFIG_NAME
    if not wpath.is_file() or not cpath.is_file():
        raise UserError("model_path", f"{src} holds no PEFT adapter ({ADAPTER_WEIGHTS_NAME} + {ADAPTER_CONFIG_NAME})")
    try:
        cfg = json.loads(cpath.read_text())
        rank = int(cfg["r"])
    except Exception as e:
        raise UserError("model_path", f"unreadable adapter config in {src}: {e}") from None
    if max_rank is not None and rank > max_rank:
        raise UserError("model_path", f"adapter rank {rank} exceeds the sampler's max_lora_rank {max_rank} "
                        "(OPENRL_VLLM_MAX_LORA_RANK)")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    unembed = any(str(t).rsplit(".", 1)[-1] == UNEMBED_TARGET for t in targets)
    return {"rank": rank, "alpha": cfg.get("lora_alpha"), "targets": sorted(targets), "unembed": unembed}


# ---------------------------------------------------------------------------- requests


def unsupported_field(job: Sample) -> str | None:
    """The first field of ``job`` that vLLM has no equivalent for (``target_prompt_logprobs``,
    ``prompt_alt_tokens_k``), or None. The sampler routes such jobs to its transformers
    backend (:class:`functions.sampler.backends.routed.RoutedBackend`)."""
    if job.target_prompt_logprobs:
        return "target_prompt_logprobs"
    if job.prompt_alt_tokens_k:
        return "prompt_alt_tokens_k"
    return None


def route_reason(job: Sample, unembed_adapters: set[str] | frozenset[str], unembed_mode: str) -> str | None:
    """Why the vLLM backend should not serve ``job`` exactly, or None. The routed backend
    (:class:`functions.sampler.backends.routed.RoutedBackend`) sends such jobs to its
    transformers backend.

    - a field without vLLM equivalent (:func:`unsupported_field`);
    - ``"prompt logprobs with lm_head LoRA"``: prompt logprobs (``prompt_logprobs``,
      ``topk_prompt_logprobs``; the SDK's ``compute_logprobs`` is one) of an adapter with an
      unembedding LoRA. vLLM 0.24 maps LoRA to logits one row per sequence, and prompt logprobs
      have one row per prompt token, so their lm_head delta lands on the wrong rows
      (vllm-project/vllm#51594; on the H200, 2026-12-02: sampler vs trainer mean |delta| 0.1-4.3
      nats after a few steps, sampled tokens unaffected);
    - ``"lm_head LoRA"``: any job on such an adapter when ``unembed_mode`` is ``"fallback"``.

    Args:
        unembed_adapters: keys of the loaded adapters that have an lm_head LoRA.
        unembed_mode: ``"keep"`` or ``"fallback"`` (``VLLMBackend.unembed_lora``).
    """
    field = unsupported_field(job)
    if field is not None:
        return field
    if job.model_path is not None and job.model_path in unembed_adapters:
        if unembed_mode == "fallback":
            return "lm_head LoRA"
        if job.prompt_logprobs or job.topk_prompt_logprobs:
            return "prompt logprobs with lm_head LoRA"
    return None


def check_supported(job: Sample) -> None:
    """Raise ``UserError`` for job fields the vLLM backend cannot serve by itself (see
    :func:`unsupported_field`; the routed backend never sends it such jobs)."""
    field = unsupported_field(job)
    if field is not None:
        raise UserError(field, "not supported by the vLLM sampler backend alone (the sampler routes such "
                        "jobs to its transformers backend)")


def sampling_kwargs(job: Sample, stop_ids: frozenset[int], stop_strs: tuple[str, ...]) -> dict:
    """``vllm.SamplingParams`` keyword arguments for one request of ``job`` (``n``, ``seed``
    and ``prompt_logprobs`` are set by the caller). ``job.sampling_params.max_tokens`` must be an
    int (the engine's validated copy)."""
    sp = job.sampling_params
    return dict(
        temperature=float(sp.temperature),
        top_p=float(sp.top_p),
        top_k=int(sp.top_k) if sp.top_k and sp.top_k > 0 else 0,
        max_tokens=int(sp.max_tokens),
        ignore_eos=True,  # EOS is in stop_ids unless the job said stop=[]
        stop_token_ids=sorted(stop_ids),
        stop=list(stop_strs) or None,
        include_stop_str_in_output=True,
        detokenize=bool(stop_strs),
        logprobs=int(job.topk_sample_logprobs),
    )


def _entries(pos: Any) -> list[tuple[int, float, int]]:
    """``[(token id, logprob, rank)]`` of one position's vLLM logprobs (a dict of
    ``Logprob``, or anything with ``items()``)."""
    return [(int(t), float(lp.logprob), int(getattr(lp, "rank", 0) or 0)) for t, lp in pos.items()]


def _topk_row(pos: Any, k: int) -> tuple[list[int], list[float]]:
    """The K best (id, logprob) of a position, best first, padded with Tinker's mask."""
    best = sorted(_entries(pos), key=lambda e: (-e[1], e[0]))[:k]
    ids = [e[0] for e in best] + [0] * (k - len(best))
    lps = [e[1] for e in best] + [TOPK_MASK_LOGPROB] * (k - len(best))
    return ids, lps


def sequence_from_output(out: Any, k: int) -> SampledSequence:
    """A ``SampledSequence`` from a vLLM ``CompletionOutput`` requested with ``logprobs=k``.

    The sampled token's logprob is read from each position's dict (vLLM always includes
    the sampled token); ``finish_reason`` "stop" -> "stop", "length" -> "length".

    Raises:
        ServerError: the request was aborted or logprobs are missing.
    """
    toks = [int(t) for t in out.token_ids]
    lps_pos = out.logprobs
    if lps_pos is None or len(lps_pos) != len(toks):
        raise ServerError("vLLM returned no logprobs for the sampled tokens")
    lps, tk_i, tk_v = [], [], []
    for t, pos in zip(toks, lps_pos):
        d = {e[0]: e[1] for e in _entries(pos)}
        if t not in d:
            raise ServerError(f"vLLM logprobs miss the sampled token {t}")
        lps.append(d[t])
        if k:
            i, v = _topk_row(pos, k)
            tk_i.append(i)
            tk_v.append(v)
    reason = out.finish_reason
    if reason not in ("stop", "length"):
        raise ServerError(f"vLLM request ended with finish_reason={reason!r}")
    return SampledSequence(tokens=toks, logprobs=lps, stop_reason=reason, topk=(tk_i, tk_v) if k else None)


def prompt_fields(res: SampleResult, job: Sample, prompt_lps: Any) -> None:
    """Fill ``prompt_logprobs`` / ``topk_prompt`` of ``res`` from vLLM's per-prompt-position
    logprobs (entry 0 None; entry t a dict holding prompt[t] and the top-K)."""
    prompt = job.prompt_tokens
    P = len(prompt)
    K = job.topk_prompt_logprobs
    if prompt_lps is None or len(prompt_lps) != P:
        raise ServerError("vLLM returned no prompt logprobs")
    first = P - job.prompt_logprobs_last_n if job.prompt_logprobs_last_n is not None else 1
    if job.prompt_logprobs:
        vals = [float("nan")]
        for t in range(1, P):
            d = {e[0]: e[1] for e in _entries(prompt_lps[t])}
            vals.append(d[prompt[t]] if t >= first and prompt[t] in d else float("nan"))
        res.prompt_logprobs = vals
    if K:
        empty_i, empty_v = [0] * K, [TOPK_MASK_LOGPROB] * K
        ids, lps = [list(empty_i)], [list(empty_v)]
        for t in range(1, P):
            if t >= first:
                i, v = _topk_row(prompt_lps[t], K)
            else:
                i, v = list(empty_i), list(empty_v)
            ids.append(i)
            lps.append(v)
        res.topk_prompt = (ids, lps)


def model_limits(model_dir: Path, max_context: int | None, has_tokenizer: bool, tokenizer: Any) -> ModelLimits:
    """Vocabulary size, context (capped at ``max_context``) and EOS ids from
    ``config.json`` / ``generation_config.json`` (and the tokenizer) without loading weights.

    Raises:
        OSError / ValueError / KeyError: ``config.json`` missing, unreadable or without
            ``vocab_size``.
    """
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    vocab = int(text["vocab_size"])
    ctx = int(text.get("max_position_embeddings") or 2**31)
    if max_context is not None:
        ctx = min(ctx, int(max_context))
    eos: set[int] = set()

    def add(x: Any) -> None:
        if isinstance(x, int):
            eos.add(x)
        elif isinstance(x, (list, tuple)):
            eos.update(int(i) for i in x)

    add(text.get("eos_token_id"))
    gpath = model_dir / "generation_config.json"
    if gpath.is_file():
        try:
            add(json.loads(gpath.read_text()).get("eos_token_id"))
        except ValueError:
            pass
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return ModelLimits(vocab_size=vocab, max_context=ctx, eos_token_ids=frozenset(i for i in eos if 0 <= i < vocab),
                       has_tokenizer=has_tokenizer)


__all__ = [
    "check_supported",
    "model_limits",
    "prepare_adapter",
    "route_reason",
    "unsupported_field",
    "prompt_fields",
    "sampling_kwargs",
    "sequence_from_output",
]
