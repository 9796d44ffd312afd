"""Logprobs: the one formula shared by the trainer and the samplers, and the trainer's
batched ``target_logprobs`` through a multi-LoRA model.

:func:`logprobs_from_logits` is ``logit[id] - logsumexp(logits)`` in float32: the trainer
(:func:`target_logprobs`) and the transformers sampler backend call it; vLLM's engine
computes the same numbers in its own process (``logprobs_mode="raw_logprobs"``, its default:
``log_softmax`` of the raw float32 logits), so every logprob the service reports for a token
is this formula.

``target_logprobs`` returns ``log p(target_t | input_<=t)`` for every position of a padded
batch, in float32, through a :class:`~openrl.model.lora.MultiLoRAModel` with a per-row adapter.
The trainer differentiates it; under ``torch.no_grad()`` it scores a sampler's tokens the
way training does (the tests and benchmarks compare the two).

Numerics: the decoder runs in the model's dtype; logits ``lm_head(h)`` are produced in the
model's dtype, then upcast to float32 and reduced as ``logit[target] - logsumexp(logits)``
(no full ``[B, T, V]`` log_softmax copy). The vocabulary projection runs over chunks of
positions (``chunk_tokens`` tokens at a time); when gradients are enabled each chunk is
activation-checkpointed, so the ``[B, T, V]`` logits are never all alive at once — the
backward recomputes one chunk at a time.

Positions are derived from the attention mask (``cumsum(mask) - 1``), so left and right
padding give the same values for the real tokens. A right-padded batch (every row's mask a
run of ones then zeros, what the trainer builds) is run with no attention mask at all: with
causal attention a real token only sees earlier positions, which are all real, so the
padding mask changes nothing for real tokens and dropping it lets SDPA use its fused
(flash) causal kernel instead of a masked one.

GPU fast paths (same formulas; used only where they apply, eager code otherwise):

* :class:`_FusedTargetLogprob`: when gradients are on, there is one target per position
  and the unembedding carries no LoRA for the batch, the vocabulary projection runs once
  per chunk: the forward computes ``lp = z[target] - logsumexp(z)`` (``z`` the float32
  logits) *and* ``G = (onehot(target) - softmax(z)) @ W`` (the gradient of ``lp`` w.r.t.
  the hidden state; times ``1 - tanh(z/c)^2`` under a softcap ``c``), kept as [N, H] in the
  model dtype; the backward is ``dL/dh = dL/dlp * G``. No [N, V] tensor outlives its chunk
  and nothing is recomputed (the checkpointed path projects each chunk twice).
* :func:`openrl.model.kernels.accelerate_model`: fused (Liger Kernel, Triton) kernels for the
  decoder's pointwise chains on CUDA: RMSNorm, SiLU(gate) * up, rotary embedding.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from openrl.model.lora import LoraRouting, MultiLoRALinear, MultiLoRAModel

#: tokens (rows x positions) per vocabulary-projection chunk.
DEFAULT_CHUNK_TOKENS = 2048


def logprobs_from_logits(logits: Tensor, ids: Tensor, lse: Tensor | None = None) -> Tensor:
    """``log softmax(logits)[ids]`` computed as ``logit[id] - logsumexp(logits)`` in float32.

    Args:
        logits: [..., V], any float dtype (upcast to float32; softcapping, if any, already
            applied).
        ids: int64 [..., K], token ids in ``[0, V)``, same leading dims as ``logits``.
        lse: float32 [..., 1], ``logsumexp`` of the float32 logits over V, when the caller
            has it already (it is computed here otherwise).

    Returns:
        float32 [..., K] natural-log probabilities (differentiable w.r.t. ``logits``).
    """
    logits = logits.float()
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return logits.gather(-1, ids) - lse


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


def _chunk_logprobs(model: MultiLoRAModel, routing: LoraRouting | None, h: Tensor, targets: Tensor,
                    softcap: float | None) -> Tensor:
    """float32 [B, c, K] ``logits[targets] - logsumexp(logits)`` for hidden states h [B, c, H]."""
    with model.routed(routing):  # re-entered on checkpoint recompute, outside use_adapters
        logits = model.lm_head(h).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logprobs_from_logits(logits, targets)


class _FusedTargetLogprob(torch.autograd.Function):
    """``lp[n] = log softmax(z_n)[target_n]``, ``z_n = softcap(h_n @ W^T)`` in float32,
    with the hidden-state gradient precomputed chunk by chunk in the forward.

    Inputs: h [N, H] (model dtype, requires grad), W [V, H] (frozen unembedding), target
    int64 [N], chunk (tokens per chunk), softcap (float or None). Output: float32 [N].
    Backward: ``dh = dlp[:, None] * G`` with ``G = (onehot - softmax(z)) [* (1 - tanh^2)] @ W``
    ([N, H], model dtype), the same product the checkpointed path forms in its backward.
    """

    @staticmethod
    def forward(ctx, h: Tensor, W: Tensor, target: Tensor, chunk: int, softcap: float | None) -> Tensor:
        N = h.shape[0]
        out = torch.empty(N, dtype=torch.float32, device=h.device)
        need = ctx.needs_input_grad[0]
        G = torch.empty_like(h) if need else None
        for s in range(0, N, chunk):
            hc, tc = h[s : s + chunk], target[s : s + chunk, None]
            z = (hc @ W.t()).float()  # [c, V]
            t = None
            if softcap:
                t = torch.tanh(z / softcap)
                z = t * softcap
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            out[s : s + chunk] = logprobs_from_logits(z, tc, lse)[:, 0]
            if need:
                d = z.sub_(lse).exp_().neg_()  # -softmax, in place
                d.scatter_add_(-1, tc, torch.ones_like(tc, dtype=d.dtype))
                if t is not None:
                    d.mul_(1 - t * t)
                G[s : s + chunk] = d.to(W.dtype) @ W
            del z, t
        if need:
            ctx.save_for_backward(G)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        (G,) = ctx.saved_tensors
        acc = torch.promote_types(G.dtype, torch.float32)
        return (G.to(acc) * g[:, None].to(acc)).to(G.dtype), None, None, None, None


def _fused_head_weight(model: MultiLoRAModel, routing: LoraRouting | None) -> Tensor | None:
    """The unembedding weight [V, H] when the fused path applies (a plain, bias-free
    projection with no LoRA for any row of ``routing``), else None."""
    head = model.lm_head
    if isinstance(head, MultiLoRALinear):
        if routing is not None and any(n in head.lora_A for n in routing.names):
            return None
        head = head.base_layer
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    return head.weight


def target_logprobs(
    model: MultiLoRAModel,
    input_ids: Tensor,
    target_ids: Tensor,
    attention_mask: Tensor | None,
    row_adapters: Sequence[str | None],
    *,
    no_grad_adapters: Sequence[str] = (),
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    fused_head: bool = True,
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
        fused_head: use :class:`_FusedTargetLogprob` where it applies (one target per
            position, no LoRA on the unembedding); False: always the checkpointed path.

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

    right_padded = T < 2 or bool((mask[:, 1:] <= mask[:, :-1]).all())

    with model.use_adapters(row_adapters, no_grad_adapters) as routing:
        if right_padded:  # causal attention alone is exact for the real tokens (module doc)
            hidden = model.hidden_states(input_ids, None, None)  # [B, T, H]
        else:
            hidden = model.hidden_states(input_ids, mask, pos)  # [B, T, H]
        W = _fused_head_weight(model, routing) if fused_head and tgt.shape[-1] == 1 else None
        if W is not None and torch.is_grad_enabled() and hidden.requires_grad:
            H = hidden.shape[-1]
            lp = _FusedTargetLogprob.apply(
                hidden.reshape(-1, H), W, tgt.reshape(-1), max(1, int(chunk_tokens)), softcap or None
            )
            out = lp.view(B, T, 1)
            out = torch.where(mask.bool().unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
            return out.squeeze(-1) if squeeze else out
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
