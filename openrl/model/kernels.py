"""Fused pointwise kernels for a transformers decoder on CUDA, from Liger Kernel.

:func:`accelerate_model` routes RMSNorm, SiLU(gate) * up and the rotary embedding of
Qwen2/Qwen3/Llama/Mistral decoders through Liger Kernel's Triton kernels
(``liger_kernel.ops``: ``LigerRMSNormFunction``, ``LigerSiLUMulFunction``,
``LigerRopeFunction``, each an ``autograd.Function`` with its own backward). CPU numerics are
untouched: every patched entry calls the original code for non-CUDA tensors.

Why Liger and not ``torch.compile``: a compiled function carries guards (grad mode,
``requires_grad``, size-1 dimensions, ``Parameter`` vs tensor) and recompiles on each new
one; after the recompile limit a ``fullgraph`` function raises ``FailOnRecompileLimitHit``
on every later call. Ordinary mixed traffic (forward and forward_backward, batch 1 and 2,
two ranks) hit it within a minute on the H200 (issue 22). A Triton kernel launched from
an ``autograd.Function`` has no guards: its specialisations are keyed by block sizes and
dtypes, of which a model has a handful.

Safety, in three layers:

1. at set-up each kernel is checked forward and backward against its eager formula on
   representative shapes on the device (relative L2 error < 1e-2 in bf16); one that fails to
   import, to launch or to match stays eager (``status`` says why);
2. every call that raises falls back to the eager formula for that call, and the kernel is
   switched off for the rest of the process (``status`` ``"failed at run time: ..."``,
   logged once as an error): a shape the check did not cover never fails a request;
3. inputs that a kernel would overwrite in place (Liger's rope rotates q and k in their
   buffers) are copied first, so no tensor autograd saved is changed behind its back.

``OPENRL_FUSED_KERNELS=0`` (:class:`openrl.config.Settings`) keeps the eager code.
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
    ``weight * (x_f32 * rsqrt(mean(x_f32^2, -1) + eps)).to(x.dtype)``; x [N, H], weight [H]."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def _silu_mul_ref(g: Tensor, u: Tensor) -> Tensor:
    """``silu(g) * u`` (the gated MLP's activation); g, u [N, I], same dtype."""
    return F.silu(g) * u


def _rope_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' ``apply_rotary_pos_emb`` with ``unsqueeze_dim=1``: q [B, hq, T, d],
    k [B, hk, T, d], cos/sin [B or 1, T, d]; ``x * cos + rotate_half(x) * sin``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(x: Tensor) -> Tensor:
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def rope_tables(b: int, t: int, d: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """cos/sin tables [b, t, d] shaped like transformers' rotary embedding output: angles of
    random positions times inverse frequencies, the d/2 columns repeated twice (``cat((f, f))``,
    which Liger's kernel relies on: it reads one half)."""
    pos = torch.randint(0, 4096, (b, t, 1), generator=gen).float()
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    ang = pos * inv
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos(), ang.sin()


def _liger_rms_norm() -> Callable:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    def fn(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        # casting_mode "llama": only the inverse RMS in float32, transformers' Qwen3/Llama
        # formula; in_place=False: dY is autograd's buffer, not ours to overwrite
        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)

    return fn


def _liger_silu_mul() -> Callable:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return lambda g, u: LigerSiLUMulFunction.apply(g, u)


def _liger_rope() -> Callable:
    from liger_kernel.ops.rope import LigerRopeFunction

    def fn(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        # Liger rotates q and k in their (contiguous) buffers: hand it copies
        return LigerRopeFunction.apply(q.clone(), k.clone(), cos, sin, None, 1)

    return fn


class _Kernel:
    """One pointwise function: the eager reference, and the Liger kernel once
    :func:`accelerate_model` has checked it (forward and backward) on the device.

    Calling it runs the kernel when there is one and falls back to the reference, for that
    call and from then on, if the kernel raises (see the module doc)."""

    def __init__(self, name: str, ref: Callable, make_fast: Callable[[], Callable], grad_args: tuple[int, ...]):
        self.name, self.ref, self.make_fast, self.fast = name, ref, make_fast, None
        self.grad_args = grad_args  # arguments that carry gradients in the model (weights are frozen)
        self.status = "eager"
        self.fallbacks = 0  # calls answered by the reference after the kernel raised
        self.enabled = True  # False: the reference even where the kernel passed its check (set_fused_kernels)

    def __call__(self, *args):
        fast = self.fast if self.enabled else None
        if fast is not None:
            try:
                return fast(*args)
            except Exception as e:  # a shape or state the check did not cover: never fail the pass
                self.fast = None
                self.status = f"failed at run time: {type(e).__name__}: {str(e)[:300]}"
                log.error("fused kernel %s raised; eager from now on: %s", self.name, self.status)
                self.fallbacks += 1
        return self.ref(*args)


_KERNELS = {
    "rms_norm": _Kernel("rms_norm", _rms_norm_ref, _liger_rms_norm, (0,)),
    "silu_mul": _Kernel("silu_mul", _silu_mul_ref, _liger_silu_mul, (0, 1)),
    "rope": _Kernel("rope", _rope_ref, _liger_rope, (0, 1)),
}
_NORM_CLASSES = ("Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm")
_MLP_CLASSES = ("Qwen3MLP", "Qwen2MLP", "LlamaMLP", "MistralMLP")
#: relative L2 error above which a kernel is rejected against its eager formula (bf16)
CHECK_REL_ERR = 1e-2


def _check(kernel: _Kernel, cases: list[tuple], device: torch.device) -> None:
    """Build ``kernel.make_fast()`` and keep it only if, on every case (tuples of CPU
    tensors, moved to ``device``; those at ``kernel.grad_args`` require grad), forward and input
    gradients match the eager reference (relative L2 error < :data:`CHECK_REL_ERR`), with
    and without grad mode. Never raises: a kernel that fails stays eager with the reason in
    ``kernel.status``."""
    if kernel.fast is not None or kernel.status.startswith("failed"):
        return
    try:
        fast = kernel.make_fast()
    except ImportError as e:
        kernel.status = f"eager (liger-kernel not importable: {e})"
        log.warning("fused kernel %s: %s", kernel.name, kernel.status)
        return
    try:
        for case in cases:
            outs = []
            for fn in (kernel.ref, fast):
                def fresh(grad: bool) -> list:
                    # new copies per pass: Liger's SiLU*up backward writes its gradients into the
                    # buffers of its inputs (as it does in the model, where nothing else reads them)
                    return [a.to(device, copy=True).requires_grad_(grad and i in kernel.grad_args)
                            if isinstance(a, Tensor) else a for i, a in enumerate(case)]

                args = fresh(True)
                y = fn(*args)
                ys = y if isinstance(y, tuple) else (y,)
                gen = torch.Generator(device="cpu").manual_seed(0)
                loss = sum((t.float() * torch.randn(t.shape, generator=gen).to(device)).sum() for t in ys)
                grads = torch.autograd.grad(loss, [a for a in args if isinstance(a, Tensor) and a.requires_grad])
                with torch.no_grad():  # the forward-only path (forward, compute_logprobs)
                    y0 = fn(*fresh(False))
                y0s = y0 if isinstance(y0, tuple) else (y0,)
                outs.append([t.detach().float() for t in ys] + [g.float() for g in grads] + [t.float() for t in y0s])
            for a, b in zip(*outs):
                err = float((a - b).norm() / a.norm().clamp_min(1e-12))
                if not err < CHECK_REL_ERR:
                    raise RuntimeError(f"{kernel.name} differs from eager: rel err {err:.3g}")
        kernel.fast, kernel.status = fast, "liger"
    except Exception as e:  # keep eager
        kernel.status = f"failed: {type(e).__name__}: {str(e)[:300]}"
        log.warning("fused kernel %s unusable, staying eager: %s", kernel.name, kernel.status)


def set_fused_kernels(enabled: bool) -> None:
    """Run the checked Liger kernels (True, the default) or their eager references (False) from
    now on, process-wide (the patches of :func:`accelerate_model` are process-wide too): for
    benchmarks that time both in one process. Kernels that failed their check stay eager
    either way; :func:`kernel_status` is unchanged."""
    for kernel in _KERNELS.values():
        kernel.enabled = bool(enabled)


def kernel_status() -> dict[str, str]:
    """``{kernel name: status}`` now (``"liger"``, ``"eager"``, ``"failed: ..."``,
    ``"failed at run time: ..."``), plus ``<name>_fallbacks`` counts where non-zero."""
    out = {k: v.status for k, v in _KERNELS.items()}
    out.update({f"{k}_fallbacks": str(v.fallbacks) for k, v in _KERNELS.items() if v.fallbacks})
    return out


def accelerate_model(base: torch.nn.Module, compile: bool = True) -> dict[str, str]:
    """Route a transformers decoder's pointwise chains through Liger's fused kernels on CUDA.

    Patches, per instance, ``forward`` of Qwen2/Qwen3/Llama/Mistral ``*RMSNorm`` modules
    (input flattened to [N, H]) and gated SiLU ``*MLP`` modules (``down(silu(gate(x)) *
    up(x))``, the product fused), and the model's module-level ``apply_rotary_pos_emb``
    (process-wide). Every patched entry calls the original code for non-CUDA tensors, so
    CPU numerics are untouched. With ``compile`` (the name kept from the torch.compile
    version) and a CUDA model, each kernel is checked on representative shapes first
    (:func:`_check`); one that fails stays eager.

    Returns:
        ``{kernel name: "liger" | "eager" | "failed: ...", "patched": "..."}``.
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

        _check(_KERNELS["rms_norm"], [(rnd(N, d), 1 + rnd(d) / 4, 1e-6) for N, d in ((1, H), (24, H), (40, hd), (17, H))], device)
        _check(_KERNELS["silu_mul"], [(rnd(N, inter), rnd(N, inter)) for N in (1, 6, 9)], device)
        rope_cases = []
        for B, T, Bc in ((2, 8, 2), (3, 5, 3), (1, 7, 1), (3, 6, 1), (1, 1, 1)):  # Bc = 1: positions shared by all rows
            cos, sin = rope_tables(Bc, T, hd, g)
            rope_cases.append((rnd(B, T, nh, hd).transpose(1, 2), rnd(B, T, nkv, hd).transpose(1, 2),
                               cos.to(dtype), sin.to(dtype)))
        _check(_KERNELS["rope"], rope_cases, device)

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
    status = kernel_status()
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
    n = gt.shape[-1]
    return m.down_proj(_KERNELS["silu_mul"](gt.reshape(-1, n), up.reshape(-1, n)).view(gt.shape))


def _rope_forward(orig: Callable, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *args, **kwargs):
    unsqueeze = kwargs.get("unsqueeze_dim", args[0] if args else 1)
    if not q.is_cuda or unsqueeze != 1 or len(args) > 1 or set(kwargs) - {"unsqueeze_dim"} or cos.dim() != 3:
        return orig(q, k, cos, sin, *args, **kwargs)
    return _KERNELS["rope"](q, k, cos, sin)
