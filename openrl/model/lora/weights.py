"""The adapters' weights of one pass, cast (and stacked) once for all its micro-batches.

Without it every LoRA layer call of every micro-batch casts each adapter's float32 ``A`` and
``B`` to the compute dtype and, with several adapters, stacks or concatenates them; its
backward then casts the gradients back, slices the stack and accumulates each adapter's
gradient with a kernel of its own. On a GPU that is tens of small kernels per layer per
micro-batch: measured on an H100 (2026-12-05, Qwen3-4B shapes, 8 RL runs x 16 datums x 191
tokens, ``bench/device_call.sh engine-rl-probe``) the trainer's pass is host-bound, the GPU busy
1.24 s of 3.06 s with micro-batches of 4,096 tokens, 0.14 s of 0.36 s for one run.

:class:`LoraWeightCache` builds each layer's operand once per pass (per layer, layout and set
of adapters) as a leaf tensor in the compute dtype, outside autograd. A trainable leaf gets a
``post_accumulate_grad`` hook: after each micro-batch's backward it adds the leaf's gradient
into the float32 parameters' ``.grad`` (one cast, one multi-tensor add) and clears it, so
gradients accumulate per micro-batch exactly as before, in the same order, with the same
values (a bf16 gradient slice added to a float32 ``.grad``). An entry is rebuilt when a
parameter changed in place since (``Tensor._version``, e.g. an optimizer step).

Layouts (``kind``): ``"one"`` (one adapter's ``A`` [r, in] or ``B`` [out, r]), ``"stack_a"`` /
``"stack_b"`` ([G, r, in] / [G, out, r], ranks zero-padded to ``r``: the grouped GEMM's
operands), ``"cat_a"`` / ``"cat_b"`` ([sum r, in] / [out, sum r]: the stacked delta's).
"""

from __future__ import annotations

import torch
from torch import Tensor


def build(kind: str, params: list[Tensor], dtype: torch.dtype, rank: int = 0) -> Tensor:
    """The operand ``kind`` of ``params`` (float32 adapter weights) in ``dtype``, without
    autograd. ``rank``: the padded rank of the ``stack_*`` layouts."""
    with torch.no_grad():
        if kind == "one":
            return params[0].to(dtype, copy=True)  # a new tensor, never the parameter itself
        if kind == "cat_a":
            return torch.cat(params, 0).to(dtype)
        if kind == "cat_b":
            return torch.cat(params, 1).to(dtype)
        if kind == "stack_a":
            return torch.stack([torch.nn.functional.pad(p, (0, 0, 0, rank - p.shape[0])) for p in params]).to(dtype)
        if kind == "stack_b":
            return torch.stack([torch.nn.functional.pad(p, (0, rank - p.shape[1])) for p in params]).to(dtype)
    raise ValueError(f"unknown layout {kind!r}")


def grad_slices(kind: str, grad: Tensor, params: list[Tensor]) -> list[Tensor]:
    """The parts of an operand's gradient that belong to each parameter (views)."""
    if kind == "one":
        return [grad]
    if kind in ("cat_a", "cat_b"):
        dim = 0 if kind == "cat_a" else 1
        return list(grad.split([p.shape[dim] for p in params], dim))
    if kind == "stack_a":
        return [grad[g, : p.shape[0]] for g, p in enumerate(params)]
    return [grad[g, :, : p.shape[1]] for g, p in enumerate(params)]


class LoraWeightCache:
    """Per-pass operands of the LoRA layers (see the module docstring). Use one per pass
    (``MultiLoRAModel.pass_weights``); not thread-safe, like the model."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[tuple[int, ...], Tensor]] = {}
        self.builds = 0  # operands built (tests, benchmarks)

    def get(self, key: object, kind: str, params: list[Tensor], trainable: list[bool], dtype: torch.dtype,
            rank: int = 0) -> Tensor:
        """The operand ``kind`` of ``params`` in ``dtype`` for layer ``key`` (built now or earlier
        in this pass).

        Args:
            key: identifies the layer and side (e.g. ``(id(layer.lora_A), "a")``).
            params: the float32 parameters, in the operand's order.
            trainable: per parameter, whether its gradient is wanted (False: used detached).
            rank: padded rank for ``stack_*``.

        Returns:
            a leaf tensor; it requires grad when any parameter is trainable and gradients are
            enabled, and its gradient then reaches those parameters' ``.grad`` after each backward.
        """
        grad = any(trainable) and torch.is_grad_enabled()
        k = (key, kind, dtype, rank, grad, tuple(id(p) for p in params), tuple(trainable))
        versions = tuple(p._version for p in params)
        hit = self._entries.get(k)
        if hit is not None and hit[0] == versions:
            return hit[1]
        w = build(kind, params, dtype, rank)
        self.builds += 1
        if grad:
            w.requires_grad_(True)
            targets = [(i, p) for i, (p, t) in enumerate(zip(params, trainable)) if t]

            def hook(leaf: Tensor, kind=kind, params=params, targets=targets) -> None:
                g = leaf.grad
                leaf.grad = None
                if g is None:
                    return
                if g.dtype != params[0].dtype:
                    g = g.to(params[0].dtype)  # one cast for all slices (float32, as the parameters)
                parts = grad_slices(kind, g, params)
                fresh, acc, add = [], [], []
                for i, p in targets:
                    if p.grad is None:
                        fresh.append((p, parts[i]))
                    else:
                        acc.append(p.grad)
                        add.append(parts[i])
                for p, part in fresh:
                    p.grad = torch.empty_like(p).copy_(part)
                if acc:
                    torch._foreach_add_(acc, add)

            w.register_post_accumulate_grad_hook(hook)
        self._entries[k] = (versions, w)
        return w


__all__ = ["LoraWeightCache", "build", "grad_slices"]
