"""The one logprob computation shared by the trainer and the (transformers) sampler.

``target_logprobs`` returns ``log p(target_t | input_<=t)`` for every position of a padded
batch, in float32, through a :class:`~openrl.lora.MultiLoRAModel` with a per-row adapter.
The trainer differentiates it; the sampler calls it under ``torch.no_grad()`` so that the
logprobs it reports for sampled tokens are computed exactly the way training computes them.

Numerics: the decoder runs in the model's dtype; logits ``lm_head(h)`` are produced in the
model's dtype, then upcast to float32 and reduced as ``logit[target] - logsumexp(logits)``
(no full ``[B, T, V]`` log_softmax copy). The vocabulary projection runs over chunks of
positions (``chunk_tokens`` tokens at a time); when gradients are enabled each chunk is
activation-checkpointed, so the ``[B, T, V]`` logits are never all alive at once — the
backward recomputes one chunk at a time.

Positions are derived from the attention mask (``cumsum(mask) - 1``), so left and right
padding give the same values for the real tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from openrl.lora import MultiLoRAModel, _Routing

#: tokens (rows x positions) per vocabulary-projection chunk.
DEFAULT_CHUNK_TOKENS = 2048


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, side: str = "right") -> tuple[Tensor, Tensor]:
    """Pad token lists into a batch.

    Args:
        seqs: B token-id lists (may differ in length; may be empty).
        pad_id: id written at padded positions.
        side: "right" (pad after the tokens) or "left".

    Returns:
        ``(input_ids, attention_mask)``, both int64 [B, T] with T = max length (at least 1);
        the mask is 1 on real tokens, 0 on padding.

    Raises:
        ValueError: unknown ``side``.
    """
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    T = max([len(s) for s in seqs] + [1])
    ids = torch.full((len(seqs), T), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        n = len(s)
        if n == 0:
            continue
        t = torch.as_tensor(list(s), dtype=torch.long)
        if side == "right":
            ids[i, :n], mask[i, :n] = t, 1
        else:
            ids[i, T - n :], mask[i, T - n :] = t, 1
    return ids, mask


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """int64 [B, T] positions: 0, 1, ... over each row's real tokens (padding gets 0 or the
    last position; its outputs are never used)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _chunk_logprobs(model: MultiLoRAModel, routing: _Routing, h: Tensor, targets: Tensor, softcap: float | None) -> Tensor:
    """float32 [B, c, K] ``logits[targets] - logsumexp(logits)`` for hidden states h [B, c, H]."""
    with model._routed(routing):  # re-entered on checkpoint recompute, outside use_adapters
        logits = model.lm_head(h).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return logits.gather(-1, targets) - lse


def target_logprobs(
    model: MultiLoRAModel,
    input_ids: Tensor,
    target_ids: Tensor,
    attention_mask: Tensor | None,
    row_adapters: Sequence[str | None],
    *,
    no_grad_adapters: Sequence[str] = (),
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """``log p(target_ids[b, t] | input_ids[b, :t+1])`` under row ``b``'s adapter.

    Args:
        model: the multi-LoRA model.
        input_ids: int64 [B, T] model input (padded).
        target_ids: int64 [B, T] (one target per position) or [B, T, K] (K candidate targets
            per position, e.g. soft/top-K targets). Values at padded positions are ignored
            but must still be valid ids.
        attention_mask: int [B, T], 1 on real tokens; None means all ones.
        row_adapters: B adapter names (None = base model only).
        no_grad_adapters: adapters used detached (forward-only rows; see
            :meth:`MultiLoRAModel.use_adapters`).
        chunk_tokens: tokens per vocabulary-projection chunk (memory/speed trade-off).

    Returns:
        float32 [B, T] (or [B, T, K]) natural-log probabilities; exactly 0.0 at padded
        positions. Differentiable w.r.t. the adapters unless called under no_grad.

    Raises:
        ValueError: shape mismatch, wrong number of row adapters, or target ids outside
            ``[0, vocab)``.
        KeyError: unknown adapter.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    squeeze = target_ids.dim() == 2
    tgt = target_ids.unsqueeze(-1) if squeeze else target_ids
    if tgt.dim() != 3 or tuple(tgt.shape[:2]) != (B, T):
        raise ValueError(f"target_ids must be [B, T] or [B, T, K] with B, T = {B}, {T}; got {tuple(target_ids.shape)}")
    if len(row_adapters) != B:
        raise ValueError(f"{len(row_adapters)} row adapters for {B} rows")
    device = model.device
    input_ids = input_ids.to(device)
    tgt = tgt.to(device=device, dtype=torch.long)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device).long()
    vocab = model.lm_head.out_features if hasattr(model.lm_head, "out_features") else None
    if vocab is not None and tgt.numel() and (int(tgt.min()) < 0 or int(tgt.max()) >= vocab):
        raise ValueError(f"target ids must lie in [0, {vocab})")
    softcap = getattr(getattr(model.base, "config", None), "final_logit_softcapping", None)
    pos = position_ids_from_mask(mask)

    with model.use_adapters(row_adapters, no_grad_adapters):
        routing = model._router.current
        hidden = model.hidden_states(input_ids, mask, pos)  # [B, T, H]
        step = max(1, int(chunk_tokens) // max(B, 1))
        pieces = []
        use_ckpt = torch.is_grad_enabled()
        for s in range(0, T, step):
            h, t = hidden[:, s : s + step], tgt[:, s : s + step]
            if use_ckpt:
                lp = checkpoint(_chunk_logprobs, model, routing, h, t, softcap, use_reentrant=False)
            else:
                lp = _chunk_logprobs(model, routing, h, t, softcap)
            pieces.append(lp)
        out = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
    out = torch.where(mask.bool().unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.squeeze(-1) if squeeze else out
