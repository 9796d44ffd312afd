"""Multi-LoRA: many runs' LoRA adapters on one frozen base model, chosen per batch row.

Several training runs (and sampling sessions) on the same base model share one
forward/backward pass: the base matmuls run once over the whole batch, and every
wrapped ``nn.Linear`` adds, for each adapter present in the batch, the low-rank delta
of the rows that use it::

    y[R_a] = x[R_a] @ W^T + (x[R_a] @ A_a^T) @ B_a^T * (alpha_a / rank_a)

where ``R_a`` are the batch rows routed to adapter ``a`` (rows routed to ``None`` get the
base model only). Gradients of ``A_a`` / ``B_a`` only receive contributions from the rows
in ``R_a``, so runs never leak gradients into each other; the base weights are frozen.

Conventions
-----------
* Adapter parameters are float32 whatever the base dtype (master weights; the optimizer
  state lives in float32 too). The delta is computed in the layer input's dtype (bf16 for a
  bf16 base, as PEFT does), the weights cast on the fly; gradients reach the float32 params.
* Rows of one adapter that are contiguous in the batch are handled with slices (no
  gather/scatter), and several adapters' deltas are computed as one pair of grouped GEMMs
  (CUDA) or one stacked, row-masked pair of matmuls (see :data:`MULTI_ADAPTER_MODE`); the
  trainer orders rows by adapter. Any row order works (index_select / index_add fallback),
  just slower.
* Initialisation follows PEFT's default (``init_lora_weights=True``): ``A`` is
  kaiming-uniform with ``a=sqrt(5)`` (i.e. U(-1/sqrt(in), 1/sqrt(in))), ``B`` is zero, so
  a fresh adapter leaves the model unchanged. ``A`` is drawn from a CPU
  ``torch.Generator`` seeded with ``LoraSpec.seed`` (modules in ``named_modules`` order,
  ``A`` only), so the same seed gives bit-identical adapters on any device.
* ``alpha`` defaults to 32 for every rank (:data:`DEFAULT_LORA_ALPHA`), the convention of
  Thinking Machines' Tinker / "LoRA Without Regret" (Schulman et al., 2025): with a fixed
  alpha the scale ``alpha/rank`` makes the best learning rate roughly rank-independent.
* Saved adapters use PEFT's layout (``adapter_model.safetensors`` with keys
  ``base_model.model.<module path>.lora_{A,B}.weight`` + ``adapter_config.json``), so
  ``peft.PeftModel.from_pretrained(base, dir)`` and vLLM's LoRA loader read them.

Thread safety: the per-row routing is state on the :class:`MultiLoRAModel` (set by
:meth:`MultiLoRAModel.use_adapters`); run one forward at a time per model instance.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from openrl.errors import UserError

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGET = "lm_head"
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS + (UNEMBED_TARGET,)

#: alpha used when ``LoraSpec.alpha`` is None (Tinker convention: 32 for all ranks).
DEFAULT_LORA_ALPHA = 32.0

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


@dataclass
class LoraSpec:
    """LoRA configuration of one adapter (mirrors the SDK's ``tinker.types.LoraConfig``).

    Attributes:
        rank: LoRA rank r (>= 1).
        alpha: LoRA alpha; the delta is scaled by ``alpha / rank``. None means
            :data:`DEFAULT_LORA_ALPHA` (32, whatever the rank).
        seed: seed of ``A``'s initialisation. None: a random seed is drawn when the adapter
            is created and recorded (see :meth:`MultiLoRAModel.adapter_spec`), so a saved run
            always knows its seed.
        train_attn: adapt q/k/v/o projections.
        train_mlp: adapt gate/up/down projections.
        train_unembed: adapt the unembedding (``lm_head``).
    """

    rank: int
    alpha: float | None = None
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def targets(self) -> tuple[str, ...]:
        """Module-name suffixes this spec adapts, in :data:`ALL_TARGETS` order."""
        out: tuple[str, ...] = ()
        if self.train_attn:
            out += ATTN_TARGETS
        if self.train_mlp:
            out += MLP_TARGETS
        if self.train_unembed:
            out += (UNEMBED_TARGET,)
        return out

    @property
    def resolved_alpha(self) -> float:
        return float(DEFAULT_LORA_ALPHA if self.alpha is None else self.alpha)

    @property
    def scaling(self) -> float:
        """``alpha / rank``, the factor applied to ``B @ A``."""
        return self.resolved_alpha / self.rank

    def validate(self) -> None:
        """Raise :class:`UserError` (field ``lora_config.*``) if the spec is unusable."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise UserError("lora_config.rank", f"must be an integer >= 1, got {self.rank!r}")
        if self.alpha is not None and not (math.isfinite(float(self.alpha)) and float(self.alpha) > 0):
            raise UserError("lora_config.alpha", f"must be a positive finite number, got {self.alpha!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise UserError("lora_config.seed", f"must be an integer, got {self.seed!r}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise UserError(
                "lora_config", "at least one of train_attn, train_mlp, train_unembed must be true"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "LoraSpec":
        return cls(
            rank=int(d["rank"]),
            alpha=None if d.get("alpha") is None else float(d["alpha"]),
            seed=None if d.get("seed") is None else int(d["seed"]),
            train_attn=bool(d.get("train_attn", True)),
            train_mlp=bool(d.get("train_mlp", True)),
            train_unembed=bool(d.get("train_unembed", True)),
        )


class _Routing:
    """Which batch rows use which adapter, for the forward passes under one ``use_adapters``.

    Attributes:
        segments: when every adapter's rows are contiguous (the trainer orders rows so):
            ``[(start, end, name | None), ...]`` tiling ``[0, batch_size)``; else None.
        groups: adapter name -> row indices (LongTensor [n] on the model's device), used
            when ``segments`` is None.
        detached: adapter names whose parameters are used detached (no gradient).
        batch_size: number of rows the routing was built for.
    """

    __slots__ = ("segments", "groups", "detached", "batch_size", "row_names", "names", "_masks")

    def __init__(
        self,
        segments: list[tuple[int, int, str | None]] | None,
        groups: dict[str, Tensor],
        detached: frozenset[str],
        batch_size: int,
        row_names: Sequence[str | None] = (),
    ):
        self.segments = segments
        self.groups = groups
        self.detached = detached
        self.batch_size = batch_size
        self.row_names = list(row_names)
        self.names = list(dict.fromkeys(n for n in self.row_names if n is not None))  # first-seen order
        self._masks: dict[tuple, Tensor] = {}

    def cached(self, key: tuple, make) -> Tensor:
        """A small per-routing tensor (offsets, scale columns) built once by ``make()``."""
        t = self._masks.get(key)
        if t is None:
            t = make()
            self._masks[key] = t
        return t

    def mask(self, names: Sequence[str], ranks: Sequence[int], scales: Sequence[float],
             dtype: torch.dtype, device: torch.device, rows: tuple[int, int]) -> Tensor:
        """[end - start, sum(ranks)] matrix for batch rows [start, end): ``scales[g]`` on
        row b / the columns of adapter g when row b uses adapter g, else 0 (cached)."""
        key = (tuple(names), tuple(ranks), tuple(scales), dtype, device, rows)
        m = self._masks.get(key)
        if m is None:
            start, end = rows
            row_names = self.row_names[start:end]
            m = torch.zeros(end - start, sum(ranks), dtype=torch.float32)
            col = 0
            for name, r, sc in zip(names, ranks, scales):
                idx = [i for i, n in enumerate(row_names) if n == name]
                m[idx, col : col + r] = sc
                col += r
            m = m.to(device=device, dtype=dtype)
            self._masks[key] = m
        return m


class _Router:
    """Holder of the current routing, shared by all MultiLoRALinear layers of one model."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: _Routing | None = None


#: How a layer applies several adapters in one batch. "stacked": one pair of matmuls over
#: the concatenated adapters with each row masked to its own adapter's columns (a fixed
#: handful of kernels, but every row pays the summed rank in FLOPs). "loop": one delta per
#: adapter on its rows (kernel-launch bound on GPU). "grouped": per-adapter products; when
#: every adapter's rows are contiguous (the trainer orders them so), one grouped GEMM per side
#: (``torch._grouped_mm``: each row block times its own adapter's weights, ranks
#: zero-padded to the largest), so a row pays only its own rank in FLOPs and the kernel
#: count does not grow with the number of adapters; falls back to "stacked" blocks where
#: ``torch._grouped_mm`` is missing or fails its one-time self-check on the device/dtype.
#: "auto": "grouped" on CUDA when the self-check passes, else consecutive adapters stacked in
#: blocks of summed rank <= STACKED_MAX_RANK_SUM.
#: Measured before "grouped" existed, on one H200 (Qwen3-4B shapes, bf16, rank 32, 8192
#: tokens per forward_backward pass): 4 runs: loop 788 ms, stacked/auto 577 ms; 8 runs:
#: 1158 / 622 ms; 16 runs: 1786 / 715 ms; one adapter over the same tokens: 550 ms; the same
#: work as one pass per run: 912 / 1467 / 3043 ms. With "grouped", docs/benchmarks.md.
MULTI_ADAPTER_MODE = "auto"
STACKED_MAX_RANK_SUM = 512


def _rank_cap() -> float:
    """Most summed rank stacked into one masked pair of matmuls (interleaved rows, and
    contiguous rows when the grouped path is not used)."""
    if MULTI_ADAPTER_MODE in ("loop", "grouped"):  # "grouped": per-adapter products throughout
        return 0
    if MULTI_ADAPTER_MODE == "stacked":
        return math.inf
    return STACKED_MAX_RANK_SUM


#: (device type, dtype) -> None (unusable) or "any" / "aligned" (group sizes must be
#: multiples of 16 rows): the result of :func:`_probe_grouped_mm`, computed once.
_GROUPED_MM_SUPPORT: dict[tuple[str, torch.dtype], str | None] = {}


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> str | None:
    """Check ``torch._grouped_mm`` (forward and backward) on ``device``/``dtype`` against a
    float32 per-group reference, once for 16-aligned and once for unaligned group sizes.

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
    """Cached :func:`_probe_grouped_mm` result for ``(device.type, dtype)``."""
    key = (torch.device(device).type, dtype)
    if key not in _GROUPED_MM_SUPPORT:
        _GROUPED_MM_SUPPORT[key] = _probe_grouped_mm(torch.device(device), dtype)
    return _GROUPED_MM_SUPPORT[key]


def _use_grouped(x: Tensor) -> bool:
    """Whether this layer call may use the grouped path (mode and self-check)."""
    if MULTI_ADAPTER_MODE == "grouped":
        return grouped_mm_support(x.device, x.dtype) is not None
    if MULTI_ADAPTER_MODE == "auto" and x.is_cuda:
        return grouped_mm_support(x.device, x.dtype) is not None
    return False


class MultiLoRALinear(nn.Module):
    """An ``nn.Linear`` plus any number of named LoRA adapters, applied per batch row.

    Input ``x``: [B, ..., in_features] with the batch as dim 0 (rows as routed by
    :meth:`MultiLoRAModel.use_adapters`). Output: ``base(x)`` plus each routed adapter's
    delta on its rows; same shape/dtype as ``base(x)``.

    Adapters are kept in plain dicts (not registered submodules), so the base model's
    ``state_dict``/``parameters`` are unchanged; use :meth:`MultiLoRAModel.adapter_parameters`.
    """

    def __init__(self, base_layer: nn.Linear, router: _Router):
        super().__init__()
        self.base_layer = base_layer
        self._router = router
        self.lora_A: dict[str, nn.Parameter] = {}  # name -> [r, in] float32
        self.lora_B: dict[str, nn.Parameter] = {}  # name -> [out, r] float32
        self.scaling: dict[str, float] = {}

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def weight(self) -> Tensor:  # some HF code reads .weight of lm_head (e.g. tying checks)
        return self.base_layer.weight

    def _delta(self, name: str, x: Tensor, detached: bool) -> Tensor:
        """``(x @ A^T) * (alpha/r) @ B^T`` for rows x [n, ..., in], in x's dtype (the float32
        master weights are cast; gradients flow back to them through the cast)."""
        A, B = self.lora_A[name], self.lora_B[name]
        if detached:
            A, B = A.detach(), B.detach()
        if A.dtype != x.dtype:
            A, B = A.to(x.dtype), B.to(x.dtype)
        return ((x @ A.t()) * self.scaling[name]) @ B.t()

    def forward(self, x: Tensor) -> Tensor:
        out = self.base_layer(x)
        routing = self._router.current
        if routing is None or not self.lora_A:
            return out
        if x.shape[0] != routing.batch_size:
            raise RuntimeError(
                f"MultiLoRALinear got a batch of {x.shape[0]} rows but routing is for {routing.batch_size}"
            )
        present = [n for n in routing.names if n in self.lora_A]
        if not present:
            return out
        grouped = routing.segments is not None and len(present) > 1 and _use_grouped(x)
        if grouped:
            cap = math.inf
        elif MULTI_ADAPTER_MODE == "grouped" and routing.segments is not None:  # grouped_mm unusable: stacked blocks
            cap = STACKED_MAX_RANK_SUM
        else:
            cap = _rank_cap()
        if routing.segments is not None:
            # Rows of each adapter are contiguous. Consecutive adapters are grouped into blocks
            # of summed rank <= cap; each block works on its slice of rows (views): a single
            # adapter as one delta, several as one stacked delta. One concatenation at the end.
            parts: list[Tensor] = []
            block: list[tuple[int, int, str]] = []
            block_rank = 0

            def flush() -> None:
                nonlocal block_rank
                if not block:
                    return
                s0, e1 = block[0][0], block[-1][1]
                whole = s0 == 0 and e1 == x.shape[0]
                xs, os = (x, out) if whole else (x[s0:e1], out[s0:e1])
                names = [n for _, _, n in block]
                if len(names) == 1:
                    d = self._delta(names[0], xs, names[0] in routing.detached)
                elif grouped and self._grouped_fits(xs, block):
                    d = self._grouped_delta(xs, block, routing)
                else:
                    d = self._stacked_delta(xs, names, routing, (s0, e1))
                parts.append(os + d.to(out.dtype))
                block.clear()
                block_rank = 0

            for start, end, name in routing.segments:
                if name is None or name not in self.lora_A:
                    flush()
                    parts.append(out[start:end])
                    continue
                r = self.lora_A[name].shape[0]
                if block and block_rank + r > cap:
                    flush()
                block.append((start, end, name))
                block_rank += r
            flush()
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if len(present) > 1 and sum(self.lora_A[n].shape[0] for n in present) <= cap:
            return out + self._stacked_delta(x, present, routing, (0, x.shape[0])).to(out.dtype)
        for name, rows in routing.groups.items():  # interleaved rows: gather / scatter-add
            if name not in self.lora_A:
                continue
            delta = self._delta(name, x.index_select(0, rows), name in routing.detached)
            out = out.index_add(0, rows, delta.to(out.dtype))
        return out

    def _stacked_delta(self, x: Tensor, names: list[str], routing: _Routing, rows: tuple[int, int]) -> Tensor:
        """Several adapters at once for batch rows ``rows`` = [start, end) (x holds exactly
        those rows): ``((x @ cat(A)^T) * M) @ cat(B)^T`` where the mask M [n, R] keeps, per
        row, only its own adapter's rank columns (times its alpha/r). Two matmuls whatever
        the number of adapters; a row never sees (nor sends gradient to) another row's
        adapter because M is exactly 0 there."""
        As, Bs = [], []
        for n in names:
            A, B = self.lora_A[n], self.lora_B[n]
            if n in routing.detached:
                A, B = A.detach(), B.detach()
            As.append(A)
            Bs.append(B)
        A_cat = torch.cat(As, 0).to(x.dtype)  # [R, in]
        B_cat = torch.cat(Bs, 1).to(x.dtype)  # [out, R]
        m = routing.mask(names, [a.shape[0] for a in As], [self.scaling[n] for n in names], x.dtype, x.device, rows)
        h = x @ A_cat.t()  # [B, ..., R]
        h = h * m.view(m.shape[0], *([1] * (x.dim() - 2)), m.shape[1])
        return h @ B_cat.t()

    def _grouped_fits(self, xs: Tensor, block: list[tuple[int, int, str]]) -> bool:
        """Layout conditions of ``torch._grouped_mm`` for this block: 16-byte aligned row
        strides on CUDA (in/out features multiples of 8 for bf16) and, where the self-check
        said so, group sizes (rows x tokens per row) that are multiples of 16."""
        if xs.is_cuda and (self.in_features % 8 or self.out_features % 8):
            return False
        if grouped_mm_support(xs.device, xs.dtype) == "aligned":
            per_row = xs[0].numel() // xs.shape[-1] if xs.shape[0] else 0
            return all(((e - s) * per_row) % 16 == 0 for s, e, _ in block)
        return True

    def _grouped_delta(self, xs: Tensor, block: list[tuple[int, int, str]], routing: _Routing) -> Tensor:
        """LoRA deltas of several adapters whose rows are contiguous, with two grouped GEMMs.

        ``xs`` [n, ..., in] holds exactly the block's rows; ``block`` lists
        ``(start, end, name)`` segments tiling them in order. With X_g the tokens of adapter g
        (flattened to [M_g, in]) and ranks zero-padded to r = max rank (rounded up to 8)::

            delta[X_g] = ((X_g @ A_g^T) * (alpha_g / r_g)) @ B_g^T

        computed as ``h = grouped_mm(X, A^T, offs)`` [M, r], ``h *= scale`` (a scalar, or a
        per-token [M, 1] column when the adapters' scales differ),
        ``grouped_mm(h, B^T, offs)`` [M, out]; the same formula as :meth:`_delta` per
        adapter (padded rank columns are exactly zero and get no gradient). Returns
        [n, ..., out] in xs's dtype.
        """
        names = [n for _, _, n in block]
        ranks = [self.lora_A[n].shape[0] for n in names]
        r = -(-max(ranks) // 8) * 8
        As, Bs = [], []
        for n, rk in zip(names, ranks):
            A, B = self.lora_A[n], self.lora_B[n]
            if n in routing.detached:
                A, B = A.detach(), B.detach()
            if rk != r:
                A = torch.nn.functional.pad(A, (0, 0, 0, r - rk))  # [r, in]
                B = torch.nn.functional.pad(B, (0, r - rk))  # [out, r]
            As.append(A)
            Bs.append(B)
        A3 = torch.stack(As).to(xs.dtype)  # [G, r, in]: one stack, one cast (few kernels)
        B3 = torch.stack(Bs).to(xs.dtype)  # [G, out, r]
        lead = xs.shape[:-1]
        x2 = xs.reshape(-1, xs.shape[-1])
        per_row = x2.shape[0] // xs.shape[0] if xs.shape[0] else 0
        s0 = block[0][0]
        offs = routing.cached(
            ("offs", tuple((s, e) for s, e, _ in block), per_row, xs.device),
            lambda: torch.tensor([(e - s0) * per_row for _, e, _ in block], dtype=torch.int32).to(xs.device),
        )
        h = torch._grouped_mm(x2, A3.transpose(1, 2), offs=offs)  # [M, r]
        scales = [self.scaling[n] for n in names]
        if len(set(scales)) == 1:
            h = h * scales[0]
        else:
            col = routing.cached(
                ("scale", tuple((s, e) for s, e, _ in block), tuple(scales), per_row, xs.dtype, xs.device),
                lambda: torch.cat(
                    [torch.full(((e - s) * per_row, 1), sc, dtype=torch.float32) for (s, e, _), sc in zip(block, scales)]
                ).to(device=xs.device, dtype=xs.dtype),
            )
            h = h * col
        d = torch._grouped_mm(h, B3.transpose(1, 2), offs=offs)  # [M, out]
        return d.view(*lead, d.shape[-1])

    def extra_repr(self) -> str:
        return f"adapters={sorted(self.lora_A)}"


class MultiLoRAModel(nn.Module):
    """A frozen causal LM whose target linears carry many LoRA adapters, chosen per row.

    Args:
        base: a ``transformers`` causal LM (e.g. ``Qwen3ForCausalLM``). Its parameters are
            frozen (``requires_grad=False``) and every ``nn.Linear`` whose attribute name is
            in :data:`ALL_TARGETS` is replaced, once, by a :class:`MultiLoRALinear`.

    Typical use::

        m = MultiLoRAModel(base)
        m.add_adapter("run-a", LoraSpec(rank=8, seed=0))
        with m.use_adapters(["run-a", None, "run-a"]):
            logits = m(input_ids, attention_mask).logits   # [3, T, V]
    """

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self._router = _Router()
        self._layers: dict[str, MultiLoRALinear] = {}  # module path in base -> layer
        self._specs: dict[str, LoraSpec] = {}
        for path, module in list(base.named_modules()):
            leaf = path.rsplit(".", 1)[-1]
            if leaf in ALL_TARGETS and type(module) is nn.Linear:
                wrapped = MultiLoRALinear(module, self._router)
                parent = base.get_submodule(path.rsplit(".", 1)[0]) if "." in path else base
                setattr(parent, leaf, wrapped)
                self._layers[path] = wrapped

    # ----------------------------------------------------------------- adapters

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.base.parameters()).dtype

    def adapter_names(self) -> list[str]:
        return list(self._specs)

    def has_adapter(self, name: str) -> bool:
        return name in self._specs

    def adapter_spec(self, name: str) -> LoraSpec:
        """The adapter's spec with ``alpha`` and ``seed`` resolved (never None)."""
        return replace(self._spec(name))

    def _spec(self, name: str) -> LoraSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise KeyError(f"no adapter named {name!r}") from None

    def _target_layers(self, spec: LoraSpec) -> list[tuple[str, MultiLoRALinear]]:
        targets = set(spec.targets())
        return [(p, l) for p, l in self._layers.items() if p.rsplit(".", 1)[-1] in targets]

    def add_adapter(self, name: str, spec: LoraSpec) -> list[nn.Parameter]:
        """Create adapter ``name`` on every targeted layer.

        ``A`` [r, in] is kaiming-uniform (PEFT default) from a CPU generator seeded with
        ``spec.seed`` (a random seed is drawn and recorded if None); ``B`` [out, r] is zero.

        Returns:
            The new trainable parameters (float32, ``requires_grad=True``), in
            :meth:`adapter_parameters` order.

        Raises:
            ValueError: an adapter of that name exists.
            UserError: invalid spec (``lora_config.*``), or no layer of the model matches.
        """
        if name in self._specs:
            raise ValueError(f"adapter {name!r} already exists")
        spec.validate()
        seed = spec.seed if spec.seed is not None else secrets.randbits(63)
        spec = replace(spec, seed=int(seed), alpha=spec.resolved_alpha)
        layers = self._target_layers(spec)
        if not layers:
            raise UserError("lora_config", "no module of this model matches the requested LoRA targets")
        gen = torch.Generator(device="cpu").manual_seed(int(seed) % (2**63))
        device = self.device
        for _, layer in layers:
            a = torch.empty(spec.rank, layer.in_features, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            b = torch.zeros(layer.out_features, spec.rank, dtype=torch.float32)
            layer.lora_A[name] = nn.Parameter(a.to(device))
            layer.lora_B[name] = nn.Parameter(b.to(device))
            layer.scaling[name] = spec.scaling
        self._specs[name] = spec
        return self.adapter_parameters(name)

    def remove_adapter(self, name: str) -> None:
        """Drop adapter ``name`` from every layer (no-op if absent)."""
        if self._specs.pop(name, None) is None:
            return
        for layer in self._layers.values():
            layer.lora_A.pop(name, None)
            layer.lora_B.pop(name, None)
            layer.scaling.pop(name, None)

    def rename_adapter(self, old: str, new: str) -> None:
        """Rename adapter ``old`` to ``new`` (same parameter objects).

        Raises:
            KeyError: ``old`` does not exist. ValueError: ``new`` exists.
        """
        spec = self._spec(old)
        if new in self._specs:
            raise ValueError(f"adapter {new!r} already exists")
        for layer in self._layers.values():
            if old in layer.lora_A:
                layer.lora_A[new] = layer.lora_A.pop(old)
                layer.lora_B[new] = layer.lora_B.pop(old)
                layer.scaling[new] = layer.scaling.pop(old)
        del self._specs[old]
        self._specs[new] = spec

    def named_adapter_parameters(self, name: str) -> list[tuple[str, nn.Parameter]]:
        """``(peft key, parameter)`` pairs of adapter ``name``, in a fixed order
        (module order of the base model, ``lora_A`` before ``lora_B``).

        Raises:
            KeyError: unknown adapter.
        """
        self._spec(name)
        out = []
        for path, layer in self._layers.items():
            if name in layer.lora_A:
                out.append((f"{_PEFT_PREFIX}{path}.lora_A.weight", layer.lora_A[name]))
                out.append((f"{_PEFT_PREFIX}{path}.lora_B.weight", layer.lora_B[name]))
        return out

    def adapter_parameters(self, name: str) -> list[nn.Parameter]:
        """Trainable parameters of adapter ``name`` (see :meth:`named_adapter_parameters`)."""
        return [p for _, p in self.named_adapter_parameters(name)]

    # ------------------------------------------------------------------ routing

    @contextlib.contextmanager
    def use_adapters(
        self, row_adapters: Sequence[str | None], no_grad_adapters: Sequence[str] = ()
    ) -> Iterator[None]:
        """Route batch row ``i`` of forwards inside the block through ``row_adapters[i]``.

        Args:
            row_adapters: one entry per batch row: an adapter name, or None for the base
                model alone.
            no_grad_adapters: adapters whose parameters are used detached inside the block
                (their rows still get the LoRA delta, but no gradient reaches the adapter).

        Nesting is allowed; the previous routing is restored on exit.

        Raises:
            KeyError: a named adapter does not exist.
        """
        prev = self._router.current
        self._router.current = self._make_routing(row_adapters, no_grad_adapters)
        try:
            yield
        finally:
            self._router.current = prev

    @contextlib.contextmanager
    def _routed(self, routing: _Routing | None) -> Iterator[None]:
        prev = self._router.current
        self._router.current = routing
        try:
            yield
        finally:
            self._router.current = prev

    def _make_routing(self, row_adapters: Sequence[str | None], no_grad_adapters: Sequence[str]) -> _Routing:
        n = len(row_adapters)
        for name in set(row_adapters):
            if name is not None and name not in self._specs:
                raise KeyError(f"no adapter named {name!r}")
        # maximal runs of equal adapter names
        segments: list[tuple[int, int, str | None]] = []
        for i, name in enumerate(row_adapters):
            if segments and segments[-1][2] == name:
                segments[-1] = (segments[-1][0], i + 1, name)
            else:
                segments.append((i, i + 1, name))
        named = [seg[2] for seg in segments if seg[2] is not None]
        if len(named) == len(set(named)):  # each adapter's rows are contiguous
            return _Routing(segments, {}, frozenset(no_grad_adapters), n, row_adapters)
        rows: dict[str, list[int]] = {}
        for i, name in enumerate(row_adapters):
            if name is not None:
                rows.setdefault(name, []).append(i)
        device = self.device
        groups = {k: torch.tensor(v, dtype=torch.long, device=device) for k, v in rows.items()}
        return _Routing(None, groups, frozenset(no_grad_adapters), n, row_adapters)

    # ------------------------------------------------------------------ forward

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kw):
        """Run the base model (HF output, ``.logits`` [B, T, V]) under the current routing.

        ``use_cache`` defaults to False. Rows are routed by the enclosing
        :meth:`use_adapters`; outside one, the base model alone runs.
        """
        kw.setdefault("use_cache", False)
        return self.base(input_ids=input_ids, attention_mask=attention_mask, **kw)

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Final (normed) hidden states [B, T, H] of the decoder, before ``lm_head``."""
        out = self.base.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return out.last_hidden_state

    @property
    def lm_head(self) -> nn.Module:
        """The output projection (a :class:`MultiLoRALinear` when it is a LoRA target)."""
        return self.base.get_output_embeddings()

    # --------------------------------------------------------------------- PEFT

    def peft_state_dict(self, name: str) -> dict[str, Tensor]:
        """Adapter ``name`` as PEFT tensors: ``base_model.model.<path>.lora_A.weight`` [r, in]
        and ``...lora_B.weight`` [out, r], float32, detached CPU copies."""
        return {k: p.detach().to("cpu", copy=True).contiguous() for k, p in self.named_adapter_parameters(name)}

    def peft_config(self, name: str) -> dict:
        """``adapter_config.json`` content for adapter ``name`` (a ``peft.LoraConfig``)."""
        spec = self._spec(name)
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": getattr(self.base, "name_or_path", None) or None,
            "r": spec.rank,
            "lora_alpha": spec.resolved_alpha,
            "lora_dropout": 0.0,
            "target_modules": sorted({p.rsplit(".", 1)[-1] for p, _ in self._target_layers(spec)}),
            "bias": "none",
            "fan_in_fan_out": False,
            "init_lora_weights": True,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
            "inference_mode": True,
            "rank_pattern": {},
            "alpha_pattern": {},
        }

    def load_peft_state_dict(
        self, name: str, state_dict: Mapping[str, Tensor], config: Mapping, seed: int | None = None
    ) -> None:
        """(Re)create adapter ``name`` from PEFT tensors and its ``adapter_config.json``.

        Args:
            state_dict: keys as produced by :meth:`peft_state_dict` (PEFT's
                ``.lora_A.default.weight`` style is accepted too).
            config: the adapter config (``r``, ``lora_alpha``, ``target_modules``).
            seed: recorded in the adapter's spec (0 if None; the weights come from ``state_dict``).

        Raises:
            UserError: config/tensors do not fit this base model (field ``checkpoint``).
        """
        try:
            rank = int(config["r"])
            alpha = float(config.get("lora_alpha", DEFAULT_LORA_ALPHA))
            targets = config.get("target_modules") or []
            if isinstance(targets, str):
                targets = [targets]
            targets = {str(t).rsplit(".", 1)[-1] for t in targets}
        except (KeyError, TypeError, ValueError) as e:
            raise UserError("checkpoint", f"bad adapter config: {e}") from None
        if config.get("use_dora") or config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
            raise UserError("checkpoint", "DoRA / rsLoRA / per-module rank or alpha are not supported")
        unknown = targets - set(ALL_TARGETS)
        if unknown:
            raise UserError("checkpoint", f"unsupported LoRA target modules {sorted(unknown)}")
        spec = LoraSpec(
            rank=rank,
            alpha=alpha,
            seed=seed,
            train_attn=bool(targets & set(ATTN_TARGETS)),
            train_mlp=bool(targets & set(MLP_TARGETS)),
            train_unembed=UNEMBED_TARGET in targets,
        )
        if set(spec.targets()) != targets:
            raise UserError(
                "checkpoint", f"target_modules {sorted(targets)} must be whole groups (attention, mlp, lm_head)"
            )
        sd = {k.replace(".lora_A.default.weight", ".lora_A.weight").replace(".lora_B.default.weight", ".lora_B.weight"): v
              for k, v in state_dict.items()}
        tmp = f"{name}\x00loading"
        self.remove_adapter(tmp)
        try:
            self.add_adapter(tmp, replace(spec, seed=seed if seed is not None else 0))
            prefix_len = len(_PEFT_PREFIX)
            expected = dict(self.named_adapter_parameters(tmp))
            missing = sorted(set(expected) - set(sd))
            if missing:
                raise UserError("checkpoint", f"adapter weights missing {len(missing)} tensors, e.g. {missing[0]}")
            extra = sorted(k for k in sd if ".lora_" in k and k not in expected)
            if extra:
                raise UserError("checkpoint", f"adapter has tensors for modules this model lacks, e.g. {extra[0][prefix_len:]}")
            with torch.no_grad():
                for k, p in expected.items():
                    t = sd[k]
                    if tuple(t.shape) != tuple(p.shape):
                        raise UserError("checkpoint", f"{k}: shape {tuple(t.shape)} != expected {tuple(p.shape)}")
                    p.copy_(t.to(device=p.device, dtype=p.dtype))
        except BaseException:
            self.remove_adapter(tmp)  # the previous adapter `name`, if any, is untouched
            raise
        self.remove_adapter(name)
        self.rename_adapter(tmp, name)


def save_peft_adapter(model: MultiLoRAModel, name: str, directory: Path) -> None:
    """Write adapter ``name`` as ``adapter_model.safetensors`` + ``adapter_config.json``
    in ``directory`` (created if needed), the layout ``peft.PeftModel.from_pretrained`` and
    vLLM's LoRA loader read."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(model.peft_state_dict(name), str(directory / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG_NAME).write_text(json.dumps(model.peft_config(name), indent=2, sort_keys=True))


def read_peft_adapter(directory: Path) -> tuple[dict[str, Tensor], dict]:
    """Read ``(state_dict, adapter_config)`` from a PEFT adapter directory.

    Raises:
        UserError: files missing or unreadable (field ``checkpoint``).
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    wpath, cpath = directory / ADAPTER_WEIGHTS_NAME, directory / ADAPTER_CONFIG_NAME
    if not wpath.is_file() or not cpath.is_file():
        raise UserError("checkpoint", f"{directory} holds no PEFT adapter ({ADAPTER_WEIGHTS_NAME} + {ADAPTER_CONFIG_NAME})")
    try:
        return load_file(str(wpath)), json.loads(cpath.read_text())
    except Exception as e:  # corrupt file
        raise UserError("checkpoint", f"cannot read adapter in {directory}: {e}") from None


def load_peft_adapter(model: MultiLoRAModel, name: str, directory: Path, seed: int | None = None) -> None:
    """(Re)create adapter ``name`` of ``model`` from a PEFT adapter directory."""
    sd, cfg = read_peft_adapter(directory)
    model.load_peft_state_dict(name, sd, cfg, seed=seed)
