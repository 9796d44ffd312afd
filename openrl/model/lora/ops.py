"""The LoRA delta kernels, pure functions of tensors (the role of vLLM's punica ops), and the
selector that picks which of them a routing uses.

Every kernel computes, for the rows it is given, the punica formula::

    y[i] += (x[i] @ lora_a[k]^T) * scale[k] @ lora_b[k]^T      k = the adapter of row i

with ``lora_a[k]`` [r_k, in] and ``lora_b[k]`` [out, r_k] (the float32 master weights, cast
on the fly to ``x``'s dtype: gradients reach the float32 parameters through the cast) and
``scale[k] = alpha_k / r_k``. They differ in how several adapters share one call:

* :func:`lora_delta`: one adapter, ``((x @ A^T) * s) @ B^T``.
* :func:`index_add_lora`: one adapter on scattered rows (gather, delta, scatter-add): the
  "CPU"/loop path, launch-bound on a GPU.
* :func:`stacked_lora_delta`: several adapters as one pair of matmuls over the concatenated
  weights, each row masked to its own adapter's rank columns (a fixed handful of kernels,
  but every row pays the summed rank in FLOPs).
* :func:`grouped_lora_delta`: several adapters with contiguous rows as two grouped GEMMs
  (``torch._grouped_mm``, ranks zero-padded to the largest): a row pays only its own rank
  and the kernel count does not grow with the number of adapters. Checked once per
  (device type, dtype) by :func:`grouped_mm_support`.

Which ones a batch uses is decided once per routing by :func:`select_plan` from the model's
:class:`LoraKernelSettings` (passed in; no module global).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch import Tensor

#: How a layer applies several adapters in one batch (:attr:`LoraKernelSettings.mode`).
MultiAdapterMode = Literal["auto", "grouped", "stacked", "loop"]
MULTI_ADAPTER_MODES: tuple[str, ...] = ("auto", "grouped", "stacked", "loop")


@dataclass(frozen=True)
class LoraKernelSettings:
    """How the LoRA layers of one :class:`~openrl.model.lora.MultiLoRAModel` apply several
    adapters in one batch: passed to the model (``MultiLoRAModel(base, kernel_settings)``,
    or assigned to its ``kernel_settings``), read when a routing is built
    (:func:`select_plan`), never on a layer call.

    Attributes:
        mode: "stacked": one pair of matmuls over the concatenated adapters with each row
            masked to its own adapter's columns (a fixed handful of kernels, but every row
            pays the summed rank in FLOPs). "loop": one delta per adapter on its rows
            (kernel-launch bound on GPU). "grouped": per-adapter products; when every
            adapter's rows are contiguous (the trainer orders them so), one grouped GEMM per
            side (``torch._grouped_mm``: each row block times its own adapter's weights,
            ranks zero-padded to the largest), so a row pays only its own rank in FLOPs and
            the kernel count does not grow with the number of adapters; falls back to
            "stacked" blocks where ``torch._grouped_mm`` is missing or fails its one-time
            self-check on the device/dtype. "auto" (default): "grouped" on CUDA when the
            self-check passes, else consecutive adapters stacked in blocks of summed rank
            <= ``stacked_max_rank_sum``.
        stacked_max_rank_sum: most summed rank stacked into one masked pair of matmuls in
            "auto" mode (and in "grouped" mode where the grouped kernel is unusable).

    Measured before "grouped" existed, on one H200 (Qwen3-4B shapes, bf16, rank 32, 8192
    tokens per forward_backward pass): 4 runs: loop 788 ms, stacked/auto 577 ms; 8 runs:
    1158 / 622 ms; 16 runs: 1786 / 715 ms; one adapter over the same tokens: 550 ms; the
    same work as one pass per run: 912 / 1467 / 3043 ms. With "grouped", docs/benchmarks.md.

    Raises:
        ValueError: an unknown ``mode`` or a ``stacked_max_rank_sum`` below 1.
    """

    mode: MultiAdapterMode = "auto"
    stacked_max_rank_sum: int = 512

    def __post_init__(self) -> None:
        if self.mode not in MULTI_ADAPTER_MODES:
            raise ValueError(f"LoraKernelSettings.mode must be one of {MULTI_ADAPTER_MODES}, not {self.mode!r}")
        if int(self.stacked_max_rank_sum) < 1:
            raise ValueError(f"LoraKernelSettings.stacked_max_rank_sum must be >= 1, not {self.stacked_max_rank_sum}")


# ------------------------------------------------------------------------ selection


@dataclass(frozen=True)
class KernelPlan:
    """The kernels one routing uses, chosen once by :func:`select_plan`.

    Attributes:
        grouped: adapters with contiguous rows may go through :func:`grouped_lora_delta`
            (a layer still falls back to stacked blocks where the layout does not fit).
        rank_cap: most summed rank stacked into one :func:`stacked_lora_delta` call
            (0: never stack, one adapter at a time; ``inf``: stack everything).
    """

    grouped: bool
    rank_cap: float


def _rank_cap(settings: LoraKernelSettings) -> float:
    """Most summed rank stacked into one masked pair of matmuls (interleaved rows, and
    contiguous rows when the grouped path is not used)."""
    if settings.mode in ("loop", "grouped"):  # "grouped": per-adapter products throughout
        return 0
    if settings.mode == "stacked":
        return math.inf
    return settings.stacked_max_rank_sum


def select_plan(contiguous: bool, n_adapters: int, device: torch.device, dtype: torch.dtype,
                settings: LoraKernelSettings = LoraKernelSettings()) -> KernelPlan:
    """Choose the kernels for a routing from ``settings``.

    Args:
        contiguous: every adapter's rows form one contiguous segment.
        n_adapters: distinct adapters in the batch.
        device, dtype: where and in which dtype the layers compute (the model's); the
            grouped kernel's one-time self-check runs for them when it could be used.
        settings: the model's :class:`LoraKernelSettings`.
    """
    mode = settings.mode
    grouped = False
    if contiguous and n_adapters > 1:
        if mode == "grouped" or (mode == "auto" and torch.device(device).type == "cuda"):
            grouped = grouped_mm_support(device, dtype) is not None
    if grouped:
        return KernelPlan(True, math.inf)
    if mode == "grouped" and contiguous:  # grouped_mm unusable: stacked blocks
        return KernelPlan(False, settings.stacked_max_rank_sum)
    return KernelPlan(False, _rank_cap(settings))


# ------------------------------------------------------------------------ kernels


def lora_delta(x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
    """``((x @ lora_a^T) * scale) @ lora_b^T`` in ``x``'s dtype.

    Args:
        x: [n, ..., in]. lora_a: [r, in]. lora_b: [out, r] (any float dtype; cast to x's).
        scale: ``alpha / r``.

    Returns:
        [n, ..., out], x's dtype.
    """
    if lora_a.dtype != x.dtype:
        lora_a, lora_b = lora_a.to(x.dtype), lora_b.to(x.dtype)
    return ((x @ lora_a.t()) * scale) @ lora_b.t()


def index_add_lora(y: Tensor, x: Tensor, rows: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
    """``y`` with the delta of one adapter added on batch rows ``rows`` (out of place).

    Args:
        y: [B, ..., out]. x: [B, ..., in]. rows: int64 [n] row indices on x's device.

    Returns:
        [B, ..., out] in y's dtype.
    """
    delta = lora_delta(x.index_select(0, rows), lora_a, lora_b, scale)
    return y.index_add(0, rows, delta.to(y.dtype))


def stacked_lora_delta(x: Tensor, lora_a: Sequence[Tensor], lora_b: Sequence[Tensor], mask: Tensor) -> Tensor:
    """Several adapters' deltas at once: ``((x @ cat(A)^T) * mask) @ cat(B)^T``.

    Args:
        x: [n, ..., in].
        lora_a: G tensors [r_g, in]; lora_b: G tensors [out, r_g].
        mask: [n, sum(r_g)] in x's dtype: ``scale_g`` on row i / the columns of adapter g
            when row i uses adapter g, else exactly 0, so a row never sees (nor sends
            gradient to) another row's adapter.

    Returns:
        [n, ..., out], x's dtype. Two matmuls whatever the number of adapters.
    """
    a_cat = torch.cat(list(lora_a), 0).to(x.dtype)  # [R, in]
    b_cat = torch.cat(list(lora_b), 1).to(x.dtype)  # [out, R]
    h = x @ a_cat.t()  # [n, ..., R]
    h = h * mask.view(mask.shape[0], *([1] * (x.dim() - 2)), mask.shape[1])
    return h @ b_cat.t()


def grouped_lora_delta(
    x: Tensor, lora_a: Sequence[Tensor], lora_b: Sequence[Tensor], offs: Tensor, scale: float | Tensor
) -> Tensor:
    """Deltas of G adapters whose rows are contiguous, with two grouped GEMMs.

    With X_g the tokens of adapter g (rows ``offs[g-1]:offs[g]`` of x flattened to [M, in])
    and ranks zero-padded to r = max rank rounded up to 8::

        delta[X_g] = ((X_g @ A_g^T) * scale_g) @ B_g^T

    computed as ``h = grouped_mm(X, A^T, offs)`` [M, r], ``h *= scale``,
    ``grouped_mm(h, B^T, offs)`` [M, out]; the same formula as :func:`lora_delta` per
    adapter (padded rank columns are exactly zero and get no gradient).

    Args:
        x: [n, ..., in], the tokens of all G groups in order.
        lora_a: G tensors [r_g, in]; lora_b: G tensors [out, r_g].
        offs: int32 [G] on x's device, cumulative token counts (end of each group).
        scale: one float for all groups, or a per-token column [M, 1] in x's dtype.

    Returns:
        [n, ..., out], x's dtype.
    """
    ranks = [a.shape[0] for a in lora_a]
    r = -(-max(ranks) // 8) * 8
    a_pad, b_pad = [], []
    for a, b, rk in zip(lora_a, lora_b, ranks):
        if rk != r:
            a = torch.nn.functional.pad(a, (0, 0, 0, r - rk))  # [r, in]
            b = torch.nn.functional.pad(b, (0, r - rk))  # [out, r]
        a_pad.append(a)
        b_pad.append(b)
    a3 = torch.stack(a_pad).to(x.dtype)  # [G, r, in]: one stack, one cast (few kernels)
    b3 = torch.stack(b_pad).to(x.dtype)  # [G, out, r]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    h = torch._grouped_mm(x2, a3.transpose(1, 2), offs=offs)  # [M, r]
    h = h * scale
    d = torch._grouped_mm(h, b3.transpose(1, 2), offs=offs)  # [M, out]
    return d.view(*lead, d.shape[-1])


# ------------------------------------------------------------------------ grouped_mm probe

#: (device type, dtype) -> None (unusable) or "any" / "aligned" (group sizes must be
#: multiples of 16 rows): the result of :func:`_probe_grouped_mm`, computed once.
_GROUPED_MM_SUPPORT: dict[tuple[str, torch.dtype], str | None] = {}


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> str | None:
    """Check ``torch._grouped_mm`` (forward and backward) on ``device``/``dtype`` against a
    float64 per-group reference, once for 16-aligned and once for unaligned group sizes.

    Returns "any" (both pass), "aligned" (only 16-row-aligned groups pass) or None. Never
    raises: a missing op, an unsupported dtype/architecture or a wrong result gives None.
    """
    if not hasattr(torch, "_grouped_mm"):
        return None
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    ok: list[bool] = []
    for sizes in ([16, 0, 32], [5, 0, 11]):
        try:
            with torch.inference_mode(False), torch.enable_grad():
                g = torch.Generator(device="cpu").manual_seed(1234)
                M, K, R, N = sum(sizes), 64, 16, 48
                x0 = torch.randn(M, K, generator=g)
                A0 = torch.randn(3, R, K, generator=g) / 8
                B0 = torch.randn(3, N, R, generator=g) / 4
                w = torch.randn(M, N, generator=g)
                x, A, B = (t.to(device=device, dtype=dtype).detach().clone().requires_grad_() for t in (x0, A0, B0))
                offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(device=device, dtype=torch.int32)
                h = torch._grouped_mm(x, A.transpose(1, 2), offs=offs)
                y = torch._grouped_mm(h, B.transpose(1, 2), offs=offs)
                (y.float() * w.to(device)).sum().backward()
                xr, Ar, Br = (t.detach().clone().double().requires_grad_() for t in (x0, A0, B0))
                ys, s = [], 0
                for i, n in enumerate(sizes):
                    ys.append((xr[s : s + n] @ Ar[i].t()) @ Br[i].t())
                    s += n
                yr = torch.cat(ys)
                (yr * w.double()).sum().backward()

                def rel(a: Tensor, b: Tensor) -> float:
                    return float((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-30))

                errs = [rel(y.detach(), yr.detach()), rel(x.grad, xr.grad), rel(A.grad, Ar.grad), rel(B.grad, Br.grad)]
                ok.append(all(e < tol for e in errs))
        except Exception:  # unsupported here: fall back to the stacked path
            ok.append(False)
    if ok[0] and ok[1]:
        return "any"
    return "aligned" if ok[0] else None


def grouped_mm_support(device: torch.device, dtype: torch.dtype) -> str | None:
    """Whether :func:`grouped_lora_delta` works on ``device``/``dtype``: None (no), "any",
    or "aligned" (only groups whose token counts are multiples of 16). Probed once per
    ``(device.type, dtype)`` and cached; never raises."""
    key = (torch.device(device).type, dtype)
    if key not in _GROUPED_MM_SUPPORT:
        _GROUPED_MM_SUPPORT[key] = _probe_grouped_mm(torch.device(device), dtype)
    return _GROUPED_MM_SUPPORT[key]
