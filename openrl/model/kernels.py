"""Fused pointwise kernels for a transformers decoder on CUDA (``torch.compile``), each
checked forward and backward against its eager formula, with the eager code as fallback.

:func:`accelerate_model` routes RMSNorm, SiLU(gate) * up and the rotary embedding of
Qwen2/Qwen3/Llama/Mistral decoders through them; CPU numerics are untouched.
"""

from __future__ import annotations

import logging
import sys
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)


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
