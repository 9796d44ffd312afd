"""Per-run AdamW honouring every field of Tinker's ``AdamParams``.

Tinker documents its Adam as identical to ``torch.optim.AdamW`` (decoupled weight decay)
with per-step hyperparameters; we use ``torch.optim.AdamW`` and set the param group's
``lr``, ``betas``, ``eps`` and ``weight_decay`` from each ``optim_step`` request. The update
for parameter p with gradient g (after clipping) at step t is::

    p <- p * (1 - lr * weight_decay)
    m <- beta1 * m + (1 - beta1) * g ;  v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

``grad_clip_norm`` > 0 first rescales all of the run's gradients by
``min(1, grad_clip_norm / (||g||_2 + 1e-6))`` where ``||g||_2`` is the global L2 norm over
the run's adapter parameters (``torch.nn.utils.clip_grad_norm_``); 0 disables clipping.
Parameters without a gradient are stepped with a zero gradient, so every step updates
every parameter's moments and applies weight decay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn

from openrl.errors import UserError

_FIELD = "adam_params"


@dataclass(frozen=True)
class AdamConfig:
    """Validated ``AdamParams`` (defaults are the SDK's ``tinker.types.AdamParams``)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    @classmethod
    def parse(cls, adam: Mapping[str, object] | None) -> "AdamConfig":
        """Validate a request's adam params dict (missing keys take the SDK defaults).

        Raises:
            UserError: ``adam_params.<key>`` unknown key, non-numeric, non-finite or out of
                range (lr, eps, weight_decay, grad_clip_norm >= 0; 0 <= beta < 1).
        """
        adam = dict(adam or {})
        kind = adam.pop("type", None)
        if kind not in (None, "adam", "adamw"):
            raise UserError(f"{_FIELD}.type", f"only AdamW is supported, got {kind!r}")
        known = {f for f in cls.__dataclass_fields__}
        vals: dict[str, float] = {}
        for key, value in adam.items():
            fld = f"{_FIELD}.{key}"
            if key not in known:
                raise UserError(fld, f"unknown field (accepted: {', '.join(sorted(known))})")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UserError(fld, f"must be a number, got {value!r}")
            if not math.isfinite(float(value)):
                raise UserError(fld, f"must be finite, got {value!r}")
            vals[key] = float(value)
        cfg = cls(**vals)
        for key in ("learning_rate", "eps", "weight_decay", "grad_clip_norm"):
            if getattr(cfg, key) < 0:
                raise UserError(f"{_FIELD}.{key}", f"must be >= 0, got {getattr(cfg, key)}")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(cfg, key) < 1.0:
                raise UserError(f"{_FIELD}.{key}", f"must be in [0, 1), got {getattr(cfg, key)}")
        return cfg


class RunOptimizer:
    """AdamW over one run's adapter parameters.

    Args:
        named_params: ``(name, parameter)`` pairs; names key the serialised state, so a state
            saved from one process loads into another with the same adapter layout.
    """

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]]):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.opt = torch.optim.AdamW(self.params, lr=0.0, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.steps = 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def grad_norm(self) -> float:
        """Global L2 norm of the current gradients (0 if none)."""
        norm = self._grad_norm_tensor()
        return 0.0 if norm is None else float(norm)

    def _grad_norm_tensor(self) -> torch.Tensor | None:
        """The global L2 norm of the gradients as a 0-dim float32 tensor on their device
        (``torch.nn.utils.get_total_norm``: one ``_foreach_norm`` per device and dtype, then the
        norm of those norms, the arithmetic ``clip_grad_norm_`` uses); None when no gradient."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return None
        if any(g.dtype != torch.float32 for g in grads):
            grads = [g.float() for g in grads]
        return torch.nn.utils.get_total_norm(grads)

    @torch.no_grad()
    def step(self, adam: AdamConfig | Mapping[str, object]) -> dict[str, float]:
        """Clip, apply one AdamW step with ``adam``'s hyperparameters, zero the gradients.

        The same arithmetic as :func:`step_many` with this run alone (so a run stepped alone
        and one stepped with others end with equal weights).

        Returns:
            metrics: ``grad_norm:mean`` (global norm before clipping), ``learning_rate:mean``.
        """
        return step_many([(self, adam)])[0]

    def _prepare(self, cfg: AdamConfig) -> float:
        """Fill missing gradients with zeros, clip (per run), create lazy state; returns the
        pre-clip global gradient norm.

        The norm is computed once and the clipping reuses it
        (``torch.nn.utils.clip_grads_with_norm_``: ``g *= min(1, max_norm / (norm + 1e-6))``,
        what ``clip_grad_norm_`` does after computing the same norm itself)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = self._grad_norm_tensor()
        if norm is not None and cfg.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, cfg.grad_clip_norm, norm)
        for g in self.opt.param_groups:  # kept in the torch optimizer's state_dict
            g["lr"] = cfg.learning_rate
            g["betas"] = (cfg.beta1, cfg.beta2)
            g["eps"] = cfg.eps
            g["weight_decay"] = cfg.weight_decay
        state = self.opt.state
        for p in self.params:
            st = state[p]
            if not st:  # as torch.optim.AdamW initialises it
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return 0.0 if norm is None else float(norm)

    def state_dict(self) -> dict:
        """torch.save-able state: per-parameter-name moments and step counts (CPU tensors)."""
        st = self.opt.state_dict()["state"]
        per_name = {}
        for i, name in enumerate(self.names):
            if i in st:
                per_name[name] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in st[i].items()}
        return {"format": "openrl.adamw.v1", "steps": self.steps, "state": per_name}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from :meth:`state_dict` output.

        Raises:
            UserError("checkpoint", ...): format or parameter names/shapes do not match.
        """
        if state.get("format") != "openrl.adamw.v1":
            raise UserError("checkpoint", f"unknown optimizer state format {state.get('format')!r}")
        per_name = state["state"]
        unknown = set(per_name) - set(self.names)
        if unknown:
            raise UserError("checkpoint", f"optimizer state for unknown parameters, e.g. {sorted(unknown)[0]}")
        new_state = {}
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            if name not in per_name:
                continue
            s = {}
            for k, v in per_name[name].items():
                if torch.is_tensor(v) and k != "step":
                    if tuple(v.shape) != tuple(p.shape):
                        raise UserError("checkpoint", f"optimizer state {name}.{k}: shape {tuple(v.shape)} != {tuple(p.shape)}")
                    v = v.to(device=p.device, dtype=p.dtype)
                s[k] = v
            new_state[i] = s
        sd = self.opt.state_dict()
        sd["state"] = new_state
        self.opt.load_state_dict(sd)
        self.steps = int(state.get("steps", 0))


@torch.no_grad()
def step_many(steps: Sequence[tuple[RunOptimizer, AdamConfig | Mapping[str, object]]]) -> list[dict[str, float]]:
    """One AdamW step for each of several runs, as one multi-tensor update.

    Every run keeps its own hyperparameters (Tinker's ``AdamParams`` per ``optim_step``
    request) and its own gradient clipping; the update itself runs as a few
    ``torch._foreach_*`` kernels over the parameters of *all* runs, with per-tensor scalar
    lists, instead of about ten kernels per parameter tensor per run (a rank-32 Qwen3-4B
    adapter has 504 tensors; 8 runs stepped one after another launched ~40k kernels).

    The arithmetic is ``torch.optim.AdamW``'s single-tensor path (PyTorch
    ``torch/optim/adamw.py`` / ``adam.py``, ``_single_tensor_adam`` with decoupled weight
    decay), op by op::

        step += 1
        p *= 1 - lr * weight_decay
        m.lerp_(g, 1 - beta1) ;  v = v * beta2 + (1 - beta2) * g * g
        p -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

    so a run's result does not depend on which other runs were stepped with it.

    Args:
        steps: ``(optimizer, adam params)`` pairs, at most one per run; a dict is validated
            with :meth:`AdamConfig.parse` first (so a bad request fails before any run moves).

    Returns:
        per run, in order: ``{"grad_norm:mean": pre-clip global norm, "learning_rate:mean": lr}``.

    Raises:
        UserError: ``adam_params.<key>`` invalid (nothing was stepped).
    """
    cfgs = [a if isinstance(a, AdamConfig) else AdamConfig.parse(a) for _, a in steps]
    norms = [opt._prepare(cfg) for (opt, _), cfg in zip(steps, cfgs)]
    # group tensors by (device, dtype): foreach kernels need one of each per list. The
    # bookkeeping is per run, not per parameter (a rank-32 Qwen3-4B adapter has 504 tensors and
    # a per-tensor Python loop cost about 40 us each on the host of a GPU-bound pass): the step
    # counts move with one foreach add and are read with one stack.
    groups: dict[tuple, dict[str, list]] = {}
    for (opt, _), cfg in zip(steps, cfgs):
        states = [opt.opt.state[p] for p in opt.params]
        counts = [st["step"] for st in states]
        if not counts:
            continue
        torch._foreach_add_(counts, 1)  # AdamW's `step += 1` (float32 scalars, exact)
        step_of = torch.stack(counts).tolist()
        bias = {t: (1 - cfg.beta1 ** t, math.sqrt(1 - cfg.beta2 ** t)) for t in set(step_of)}  # one step in practice
        by_key: dict[tuple, list[int]] = {}
        for j, p in enumerate(opt.params):
            by_key.setdefault((p.device, p.dtype), []).append(j)
        for key, idx in by_key.items():
            g = groups.setdefault(key, {k: [] for k in
                                  ("p", "g", "m", "v", "decay", "w1", "b2", "w2", "bc2", "eps", "neg_step")})
            n = len(idx)
            g["p"].extend(opt.params[j] for j in idx)
            g["g"].extend(opt.params[j].grad for j in idx)
            g["m"].extend(states[j]["exp_avg"] for j in idx)
            g["v"].extend(states[j]["exp_avg_sq"] for j in idx)
            g["decay"].extend([1 - cfg.learning_rate * cfg.weight_decay] * n)
            g["w1"].extend([1 - cfg.beta1] * n)
            g["b2"].extend([cfg.beta2] * n)
            g["w2"].extend([1 - cfg.beta2] * n)
            g["eps"].extend([cfg.eps] * n)
            g["bc2"].extend(bias[step_of[j]][1] for j in idx)
            g["neg_step"].extend(-(cfg.learning_rate / bias[step_of[j]][0]) for j in idx)
    for g in groups.values():
        torch._foreach_mul_(g["p"], g["decay"])
        by_w1: dict[float, list[int]] = {}  # lerp's foreach form takes one weight: group by beta1
        for i, w in enumerate(g["w1"]):
            by_w1.setdefault(w, []).append(i)
        for w, idx in by_w1.items():
            torch._foreach_lerp_([g["m"][i] for i in idx], [g["g"][i] for i in idx], w)
        torch._foreach_mul_(g["v"], g["b2"])
        torch._foreach_addcmul_(g["v"], g["g"], g["g"], g["w2"])
        denom = torch._foreach_sqrt(g["v"])
        torch._foreach_div_(denom, g["bc2"])
        torch._foreach_add_(denom, g["eps"])
        torch._foreach_addcdiv_(g["p"], g["m"], denom, g["neg_step"])
    out = []
    for (opt, _), cfg, norm in zip(steps, cfgs, norms):
        opt.steps += 1
        opt.zero_grad()
        out.append({"grad_norm:mean": norm, "learning_rate:mean": cfg.learning_rate})
    return out
