"""The one logprob computation shared by the trainer and the (transformers) sampler.

``target_logprobs`` returns ``log p(target_t | input_<=t)`` for every position of a padded
batch, in float32, through a :class:`~openrl.model.lora.MultiLoRAModel` with a per-row adapter.
The trainer differentiates it; the sampler calls it under ``torch.no_grad()`` so that the
logprobs it reports for sampled tokens are computed exactly the way training computes them.

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
* :func:`accelerate_model`: fused (``torch.compile``) kernels for the decoder's pointwise
  chains on CUDA: RMSNorm, SiLU(gate) * up, rotary embedding.
"""

from __future__ import annotations

import logging
import sys
from functools import partial
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from openrl.model.lora import MultiLoRALinear, MultiLoRAModel, _Routing

log = logging.getLogger(__name__)

#: tokens (rows x positions) per vocabulary-projection chunk.
DEFAULT_CHUNK_TOKENS = 2048
#: use :class:`_FusedTargetLogprob` where it applies (False: always the checkpointed path).
FUSED_LOGPROB = True


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
            out[s : s + chunk] = (z.gather(-1, tc) - lse)[:, 0]
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


def _fused_head_weight(model: MultiLoRAModel, routing: _Routing | None) -> Tensor | None:
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

    right_padded = T < 2 or bool((mask[:, 1:] <= mask[:, :-1]).all())

    with model.use_adapters(row_adapters, no_grad_adapters):
        routing = model._router.current
        if right_padded:  # causal attention alone is exact for the real tokens (module doc)
            hidden = model.hidden_states(input_ids, None, None)  # [B, T, H]
        else:
            hidden = model.hidden_states(input_ids, mask, pos)  # [B, T, H]
        W = _fused_head_weight(model, routing) if FUSED_LOGPROB and tgt.shape[-1] == 1 else None
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


# --------------------------------------------------------------------------------------
# Fused pointwise kernels for the decoder on CUDA (torch.compile), with an eager fallback.


def _rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm exactly as transformers' Qwen3/Llama ``*RMSNorm`` computes it:
    ``weight * (x_f32 * rsqrt(mean(x_f32^2, -1) + eps)).to(x.dtype)``; x [..., H]."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def _silu_mul_ref(g: Tensor, u: Tensor) -> Tensor:
    """``silu(g) * u`` (the gated MLP's activation), same shapes/dtype."""
    return F.silu(g) * u


def _rope_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' ``apply_rotary_pos_emb`` with ``unsqueeze_dim=1``: q [B, hq, T, d],
    k [B, hk, T, d], cos/sin [B, T, d]; ``x * cos + rotate_half(x) * sin``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(x: Tensor) -> Tensor:
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


class _Kernel:
    """One pointwise function: the eager reference, and a compiled version once
    :func:`accelerate_model` has checked it (forward and backward) on the device."""

    def __init__(self, name: str, ref: Callable, grad_args: tuple[int, ...]):
        self.name, self.ref, self.fast = name, ref, None
        self.grad_args = grad_args  # arguments that carry gradients in the model (weights are frozen)
        self.status = "eager"

    def __call__(self, *args):
        return (self.fast or self.ref)(*args)


_KERNELS = {
    "rms_norm": _Kernel("rms_norm", _rms_norm_ref, (0,)),
    "silu_mul": _Kernel("silu_mul", _silu_mul_ref, (0, 1)),
    "rope": _Kernel("rope", _rope_ref, (0, 1)),
}
_NORM_CLASSES = ("Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm")
_MLP_CLASSES = ("Qwen3MLP", "Qwen2MLP", "LlamaMLP", "MistralMLP")


def _compile_checked(kernel: _Kernel, cases: list[tuple], device: torch.device) -> None:
    """Compile ``kernel.ref`` and keep it only if, on every case (tuples of CPU tensors,
    moved to ``device``; those at ``kernel.grad_args`` require grad), forward and input
    gradients match the eager reference (relative L2 error < 1e-2 in bf16). Never raises."""
    if kernel.fast is not None or kernel.status.startswith("failed"):
        return
    try:
        fast = torch.compile(kernel.ref, dynamic=True, fullgraph=True)
        for case in cases:
            outs = []
            for fn in (kernel.ref, fast):
                args = [a.to(device).requires_grad_(i in kernel.grad_args) if isinstance(a, Tensor) else a
                        for i, a in enumerate(case)]
                y = fn(*args)
                ys = y if isinstance(y, tuple) else (y,)
                gen = torch.Generator(device="cpu").manual_seed(0)
                loss = sum((t.float() * torch.randn(t.shape, generator=gen).to(device)).sum() for t in ys)
                grads = torch.autograd.grad(loss, [a for a in args if isinstance(a, Tensor) and a.requires_grad])
                outs.append([t.detach().float() for t in ys] + [g.float() for g in grads])
            for a, b in zip(*outs):
                err = float((a - b).norm() / a.norm().clamp_min(1e-12))
                if not err < 1e-2:
                    raise RuntimeError(f"compiled {kernel.name} differs from eager: rel err {err:.3g}")
        kernel.fast, kernel.status = fast, "compiled"
    except Exception as e:  # keep eager
        kernel.status = f"failed: {type(e).__name__}: {str(e)[:300]}"
        log.warning("torch.compile of %s unusable, staying eager: %s", kernel.name, kernel.status)


def accelerate_model(base: torch.nn.Module, compile: bool = True) -> dict[str, str]:
    """Route a transformers decoder's pointwise chains through fused kernels on CUDA.

    Patches, per instance, ``forward`` of Qwen2/Qwen3/Llama/Mistral ``*RMSNorm`` modules
    (input flattened to [N, H]) and gated SiLU ``*MLP`` modules (``down(silu(gate(x)) *
    up(x))``, the product fused), and the model's module-level ``apply_rotary_pos_emb``
    (process-wide). Every patched entry calls the original code for non-CUDA tensors, so
    CPU numerics are untouched. The compiled kernels (``torch.compile(dynamic=True)``) are
    checked forward and backward against the eager formulas on representative shapes first;
    any that fails to compile or to match stays eager.

    Returns:
        ``{kernel name: "compiled" | "eager" | "failed: ..."}``.
    """
    device = next(base.parameters()).device
    dtype = next(base.parameters()).dtype
    cfg = getattr(base, "config", None)
    H = int(getattr(cfg, "hidden_size", 64))
    nh = int(getattr(cfg, "num_attention_heads", 4))
    nkv = int(getattr(cfg, "num_key_value_heads", nh) or nh)
    hd = int(getattr(cfg, "head_dim", None) or H // nh)
    inter = int(getattr(cfg, "intermediate_size", 4 * H))
    if compile and device.type == "cuda":
        g = torch.Generator(device="cpu").manual_seed(0)

        def rnd(*shape):
            return torch.randn(*shape, generator=g).to(dtype)

        _compile_checked(_KERNELS["rms_norm"], [(rnd(N, d), 1 + rnd(d) / 4, 1e-6) for N, d in ((24, H), (40, hd), (17, H))], device)
        _compile_checked(_KERNELS["silu_mul"], [(rnd(N), rnd(N)) for N in (6 * inter, 9 * inter)], device)
        rope_cases = []
        for B, T, Bc in ((2, 8, 2), (3, 5, 3), (1, 7, 1), (3, 6, 1)):  # Bc = 1: positions shared by all rows
            rope_cases.append((rnd(B, T, nh, hd).transpose(1, 2), rnd(B, T, nkv, hd).transpose(1, 2), rnd(Bc, T, hd), rnd(Bc, T, hd)))
        _compile_checked(_KERNELS["rope"], rope_cases, device)

    n_norm = n_mlp = 0
    for m in base.modules():
        name = type(m).__name__
        if name in _NORM_CLASSES and hasattr(m, "variance_epsilon") and not hasattr(m, "_openrl_eager_forward"):
            m._openrl_eager_forward = m.forward
            m.forward = partial(_norm_forward, m)
            n_norm += 1
        elif name in _MLP_CLASSES and not hasattr(m, "_openrl_eager_forward"):
            act = getattr(m, "act_fn", None)
            if type(act).__name__ in ("SiLUActivation", "SiLU") or act is F.silu:
                m._openrl_eager_forward = m.forward
                m.forward = partial(_mlp_forward, m)
                n_mlp += 1
    n_rope = 0
    for mod_name in {type(m).__module__ for m in base.modules()}:
        mod = sys.modules.get(mod_name)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is not None and not getattr(fn, "_openrl_fused", False):
            wrapped = partial(_rope_forward, fn)
            wrapped._openrl_fused = True  # type: ignore[attr-defined]
            setattr(mod, "apply_rotary_pos_emb", wrapped)
            n_rope += 1
    status = {k: v.status for k, v in _KERNELS.items()}
    status["patched"] = f"{n_norm} norms, {n_mlp} mlps, {n_rope} rope modules"
    return status


def _norm_forward(m: torch.nn.Module, x: Tensor) -> Tensor:
    if not x.is_cuda:
        return m._openrl_eager_forward(x)
    return _KERNELS["rms_norm"](x.reshape(-1, x.shape[-1]), m.weight, float(m.variance_epsilon)).view(x.shape)


def _mlp_forward(m: torch.nn.Module, x: Tensor) -> Tensor:
    if not x.is_cuda:
        return m._openrl_eager_forward(x)
    gt, up = m.gate_proj(x), m.up_proj(x)
    return m.down_proj(_KERNELS["silu_mul"](gt.reshape(-1), up.reshape(-1)).view(gt.shape))


def _rope_forward(orig: Callable, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *args, **kwargs):
    unsqueeze = kwargs.get("unsqueeze_dim", args[0] if args else 1)
    if not q.is_cuda or unsqueeze != 1 or len(args) > 1 or set(kwargs) - {"unsqueeze_dim"} or cos.dim() != 3:
        return orig(q, k, cos, sin, *args, **kwargs)
    return _KERNELS["rope"](q, k, cos, sin)
