"""The trainer engine: one frozen base model, many training runs, co-batched passes.

One :class:`TrainerEngine` holds one base model (loaded with
``AutoModelForCausalLM.from_pretrained``) wrapped in a :class:`~openrl.model.lora.MultiLoRAModel`,
and per training run (``model_id``) a LoRA adapter plus its AdamW state.

Co-batching: :meth:`TrainerEngine.forward_backward` takes forward / forward_backward
requests ("items") of *several* runs and executes them as one packed pass: the rows (datums)
of all items are padded into shared batches (split into micro-batches of at most
``max_rows`` rows and ``max_tokens`` padded tokens), the base matmuls are shared, and each
row's LoRA delta uses its own run's adapter. One backward per micro-batch sends every run's
gradient into its own adapter only (rows never interact), where it accumulates until that
run's :meth:`optim_step`. Rows of ``forward_only`` items contribute no gradient (their
adapter is used detached when no other item of the same run needs a gradient).

Ordering is the caller's job: pass items that may run together (for one run: requests in
``seq_id`` order, never across an ``optim_step`` or a weight load of that run).

On CUDA the engine routes the decoder's pointwise chains (RMSNorm, SiLU * up, rotary)
through Liger Kernel's fused, checked Triton kernels (:func:`openrl.model.kernels.accelerate_model`;
``OPENRL_FUSED_KERNELS=0`` keeps eager code), LoRA deltas of several runs go through grouped
GEMMs (the model's :class:`openrl.model.lora.LoraKernelSettings`), and the vocabulary projection
computes its gradient in the forward (``openrl.model.logprobs``, :attr:`TrainerEngine.fused_head`);
nothing is recomputed. CPU numerics are unchanged.

The rows of a pass, their micro-batch plan and the per-row loss step live in
:mod:`functions.trainer.rows` (shared with :mod:`functions.trainer.distributed`); checkpoints,
state dicts and sampler snapshots in :mod:`functions.trainer.run_state`.

Not thread-safe: call it from one thread (or serialise calls).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
from torch.profiler import record_function

from functions.trainer import determinism, losses
from functions.trainer.mismatch import MismatchStats
from functions.trainer.memory_plan import ActivationBudget
from functions.trainer.optim import AdamConfig, RunOptimizer, step_many
from functions.trainer.rows import (
    Row,
    padded_tokens,
    plan_micro_batches,
    prepare_item,
    row_step,
    runs_span_micro_batches,
)
from functions.trainer.run_state import OPTIMIZER_NAME, RUN_NAME, Run, RunStateIO
from openrl.config import Settings
from openrl.edge.proto import FwdBwdDatum
from openrl.errors import NotFound, ServerError, UserError
from openrl.observe import startup
from openrl.model.lora import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, LoraSpec, MultiLoRAModel, PreparedAdapter
from openrl.model.kernels import accelerate_model, kernel_status
from openrl.model.logprobs import DEFAULT_CHUNK_TOKENS, pad_batch, target_logprobs

log = logging.getLogger(__name__)


#: One training example: the decoded datum the gateway checks and the trainer function hands
#: over (:class:`openrl.edge.proto.FwdBwdDatum`: ``tokens`` T ids, ``loss_fn_inputs`` dense arrays).
Datum = FwdBwdDatum


@dataclass
class FwdBwdItem:
    """One forward or forward_backward request of one run."""

    model_id: str
    datums: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None
    forward_only: bool = False


@dataclass
class FwdBwdResult:
    """Result of one item.

    Attributes:
        loss_fn_outputs: per datum ``{"logprobs": float32 array shaped like target_tokens}``
            ([T], or [T, K] for 2-D targets).
        metrics: ``{"loss:sum": float}``, the loss summed over the item's datums and tokens;
            for an item whose datums carry sampler logprobs also the sampler–trainer mismatch
            (:data:`functions.trainer.mismatch.METRIC_KEYS`) over all its datums.
        mismatch: those mismatch sums (None when no datum carried sampler logprobs), for the
            trainer's Prometheus histograms.
        error: a :class:`UserError` / :class:`NotFound` if the item was invalid (nothing ran
            for it), a :class:`ServerError` if the pass failed (no gradient was kept).
    """

    loss_fn_outputs: list[dict[str, np.ndarray]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    error: Exception | None = None
    mismatch: MismatchStats | None = None


class TrainerEngine(RunStateIO):
    """Training runs on one base model.

    Args:
        base_model_dir: a Hugging Face model directory (config + safetensors).
        device: torch device for the model and adapters.
        dtype: dtype of the base weights (adapters and optimizer state are float32).
        max_rows: most datums (rows) per micro-batch.
        max_tokens: most padded tokens (rows x longest row) per micro-batch; a single longer
            row still runs, alone.
        chunk_tokens: tokens per vocabulary-projection chunk (see ``openrl.model.logprobs``).
        fused_kernels: use the fused LoRA kernels on CUDA (:func:`openrl.model.kernels.accelerate_model`);
            None: ``Settings().fused_kernels`` (``$OPENRL_FUSED_KERNELS``, default on).
        deterministic: the deterministic mode (:mod:`functions.trainer.determinism`): one row per
            micro-batch in row order, the checkpointed vocabulary projection, deterministic
            algorithms, no fused kernels; a run's numbers do not depend on the other runs of a pass.
    """

    def __init__(
        self,
        base_model_dir: Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_rows: int = 64,
        max_tokens: int = 32768,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        fused_kernels: bool | None = None,
        deterministic: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        with startup.timed("trainer_model_load"):
            base = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=dtype)
        self._setup(base, Path(base_model_dir), device, max_rows, max_tokens, chunk_tokens, fused_kernels,
                    deterministic)

    @classmethod
    def from_base_model(
        cls,
        base: torch.nn.Module,
        device: str | torch.device = "cpu",
        max_rows: int = 64,
        max_tokens: int = 32768,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        name: str = "",
        fused_kernels: bool | None = None,
        deterministic: bool = False,
    ) -> "TrainerEngine":
        """An engine around an already-built causal LM (benchmarks, tests); ``name`` is
        recorded as the base model directory in saved ``run.json`` files."""
        self = cls.__new__(cls)
        self._setup(base, Path(name), device, max_rows, max_tokens, chunk_tokens, fused_kernels, deterministic)
        return self

    def _setup(self, base, base_model_dir: Path, device, max_rows: int, max_tokens: int, chunk_tokens: int,
               fused_kernels: bool | None = None, deterministic: bool = False) -> None:
        self.base_model_dir = base_model_dir
        #: the deterministic mode (functions/trainer/determinism.py)
        self.deterministic = bool(deterministic)
        if self.deterministic:
            determinism.configure(base, torch.device(device))
        with startup.timed("trainer_to_device"):
            base.to(device).eval()
        #: dtype of the frozen base weights (adapters and optimizer state are float32)
        self.dtype = next(base.parameters()).dtype
        self.model = MultiLoRAModel(base)
        self.device = torch.device(device)
        self._patched: str | None = None  # what accelerate_model patched (CUDA with fused kernels only)
        #: cast each run's adapter to the compute dtype once per pass where its rows span several
        #: micro-batches (``Settings().lora_pass_cache``, ``$OPENRL_LORA_PASS_CACHE``, default off)
        self.pass_cache = Settings().lora_pass_cache
        if fused_kernels is None:
            fused_kernels = Settings().fused_kernels
        if self.device.type == "cuda" and fused_kernels and not self.deterministic:
            with startup.timed("trainer_kernels"):
                self._patched = accelerate_model(base)["patched"]
        self.max_rows = int(max_rows)
        self.max_tokens = int(max_tokens)
        self.chunk_tokens = int(chunk_tokens)
        #: the vocabulary projection's fused logprob path where it applies (False: checkpointed;
        #: ``openrl.model.logprobs.target_logprobs``'s ``fused_head``)
        self.fused_head = not self.deterministic
        cfg = base.config
        #: CUDA: the micro-batch token cap from free memory (functions/trainer/memory_plan.py); None on CPU
        self.budget = ActivationBudget.for_engine(self.device, cfg, self.dtype)
        self.vocab_size = int(self.model.lm_head.out_features)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
        pad = getattr(cfg, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        self.runs: dict[str, Run] = {}

    @property
    def kernels(self) -> dict[str, str]:
        """Fused-kernel status per kernel, now (a kernel that raised at run time has gone
        eager since: :func:`openrl.model.kernels.kernel_status`); empty on CPU or with
        ``fused_kernels`` off."""
        if self._patched is None:
            return {}
        return {**kernel_status(), "patched": self._patched}

    # -------------------------------------------------------------------- runs

    def prepare_run(self, spec: LoraSpec) -> PreparedAdapter:
        """A new run's adapter tensors (:meth:`MultiLoRAModel.prepare_adapter`), made outside
        the engine lock; :meth:`create_run` attaches them.

        Raises:
            UserError: invalid spec (``lora_config.*``).
        """
        return self.model.prepare_adapter(spec)

    def create_run(self, model_id: str, spec: LoraSpec, prepared: PreparedAdapter | None = None) -> None:
        """Create run ``model_id`` with a fresh adapter (seeded init, B = 0; ``prepared`` by
        :meth:`prepare_run` from the same spec, else made here) and AdamW.

        Raises:
            UserError: invalid spec (``lora_config.*``).
            ValueError: the run exists.
        """
        if model_id in self.runs:
            raise ValueError(f"run {model_id!r} already exists")
        self.model.add_adapter(model_id, spec, prepared=prepared)
        self.runs[model_id] = Run(self.model.adapter_spec(model_id), self._new_optimizer(model_id))

    def has_run(self, model_id: str) -> bool:
        return model_id in self.runs

    def run_spec(self, model_id: str) -> LoraSpec:
        """The run's spec with alpha and seed resolved."""
        return self._run(model_id).spec

    def delete_run(self, model_id: str) -> None:
        """Drop the run's adapter, gradients and optimizer state (no-op if absent)."""
        if self.runs.pop(model_id, None) is not None:
            self.model.remove_adapter(model_id)

    def _run(self, model_id: str) -> Run:
        run = self.runs.get(model_id)
        if run is None:
            raise NotFound("model_id", f"no training run {model_id!r} on this trainer")
        return run

    def _new_optimizer(self, model_id: str) -> RunOptimizer:
        return RunOptimizer(self.model.named_adapter_parameters(model_id))

    # ------------------------------------------------------------ validation

    def _prepare(self, idx: int, item: FwdBwdItem) -> tuple[list[Row], dict[str, float]]:
        """Item ``idx``'s rows (:func:`functions.trainer.rows.prepare_item`) and resolved loss config.

        Raises:
            NotFound: unknown run. UserError: an invalid datum or loss config (names the field).
        """
        self._run(item.model_id)
        config = losses.resolve_config(item.loss_fn, item.loss_fn_config)
        rows = prepare_item(idx, item.datums, item.loss_fn, item.forward_only, vocab_size=self.vocab_size,
                            max_positions=self.max_positions, device=self.device)
        return rows, config

    # ------------------------------------------------------------------ passes

    def _micro_batches(self, rows: list[Row], max_tokens: int | None = None) -> list[list[Row]]:
        """:func:`functions.trainer.rows.plan_micro_batches` with this engine's ``max_rows`` and
        ``max_tokens`` (or the given token cap)."""
        return plan_micro_batches(rows, self.max_rows, self.max_tokens if max_tokens is None else max_tokens)

    def forward_backward(self, items: Sequence[FwdBwdItem]) -> list[FwdBwdResult]:
        """Run forward (and, unless ``forward_only``, backward) for all items in one packed pass.

        Each item is validated first; an invalid item gets its error in its result and the
        others still run. Gradients accumulate into each run's adapter until its
        :meth:`optim_step`. If the pass itself fails, every run's gradients are restored to
        their state before the call and every valid item's result carries a ServerError.

        Returns:
            one :class:`FwdBwdResult` per item, in order.
        """
        if startup.first("trainer_first_pass"):  # Triton compile / autotune on CUDA: a cold-start phase
            with startup.timed("trainer_first_pass"):
                return self._forward_backward(items)
        return self._forward_backward(items)

    def _prepare_all(
        self, items: Sequence[FwdBwdItem]
    ) -> tuple[list[FwdBwdResult], dict[int, dict[str, float]], list[Row]]:
        """Validate every item: ``(results, configs, rows)``, where ``results[i].error`` holds item
        i's :class:`UserError` (the others are empty), ``configs[i]`` its resolved loss config and
        ``rows`` the datums of the valid items, in order (deterministic, so every rank of the
        distributed engine finds the same errors)."""
        results = [FwdBwdResult() for _ in items]
        configs: dict[int, dict[str, float]] = {}
        all_rows: list[Row] = []
        for i, item in enumerate(items):
            try:
                rows, configs[i] = self._prepare(i, item)
            except UserError as e:
                results[i].error = e
                continue
            all_rows.extend(rows)
        return results, configs, all_rows

    def _forward_backward(self, items: Sequence[FwdBwdItem]) -> list[FwdBwdResult]:
        with record_function("openrl.trainer.prepare"):
            results, configs, all_rows = self._prepare_all(items)
        valid = [i for i in range(len(items)) if results[i].error is None]
        for i in valid:
            results[i].loss_fn_outputs = [{} for _ in items[i].datums]
            results[i].metrics = {"loss:sum": 0.0}
        if not all_rows:
            return results

        grad_runs = {items[r.item].model_id for r in all_rows if r.grad}
        snapshot = {
            m: [None if p.grad is None else p.grad.detach().clone() for p in self.runs[m].optimizer.params]
            for m in grad_runs
        }
        while True:
            loss_sums = {i: 0.0 for i in valid}
            mismatch = {i: MismatchStats() for i in valid}
            for i in valid:
                results[i].metrics = {"loss:sum": 0.0}
            oom = None
            failed: list[Row] = []
            try:
                plan = self._plan(all_rows)
                with self._pass_weights(plan, items):
                    for mb in plan:
                        failed = mb
                        self._run_measured(mb, items, configs, results, loss_sums, mismatch)
                break
            except Exception as e:  # restore gradients: a failed pass must not half-apply
                for m, grads in snapshot.items():
                    for p, g in zip(self.runs[m].optimizer.params, grads):
                        p.grad = None if g is None else g.clone()
                if not isinstance(e, torch.cuda.OutOfMemoryError):
                    err = ServerError(f"forward_backward pass failed: {type(e).__name__}: {e}")
                    for i in valid:
                        results[i] = FwdBwdResult(error=err)
                    return results
                oom = str(e).splitlines()[0][:200]
            # out of the except block: the exception's frames (and the pass's activations) are freed
            torch.cuda.empty_cache()
            if not self._shrink_micro_batches(all_rows, failed, oom):
                del snapshot
                return self._after_oom(items, results, valid, all_rows, oom)
        for i in valid:
            results[i].metrics["loss:sum"] = float(loss_sums[i])
            if not mismatch[i].empty:
                results[i].metrics.update(mismatch[i].metrics())
                results[i].mismatch = mismatch[i]
        return results

    def _plan(self, rows: list[Row]) -> list[list[Row]]:
        """The pass's micro-batches: capped by ``max_tokens`` and, on CUDA, by the tokens the
        memory left now holds (:class:`~functions.trainer.memory_plan.ActivationBudget`); in the
        deterministic mode one row each, in row order (:func:`functions.trainer.determinism.plan_rows`)."""
        if self.deterministic:
            return determinism.plan_rows(rows)
        if self.budget is None:
            return self._micro_batches(rows)
        cap = min(self.max_tokens, self.budget.cap(any(r.grad for r in rows)))
        return self._micro_batches(rows, cap)

    def _pass_weights(self, plan: Sequence[Sequence[Row]], items: Sequence[FwdBwdItem]):
        """``self.model.pass_weights()`` (each adapter cast once for the pass) when
        :attr:`pass_cache` is on and some run's rows span several micro-batches of ``plan``
        (:func:`~functions.trainer.rows.runs_span_micro_batches`), else a no-op context."""
        if self.pass_cache and runs_span_micro_batches(plan, lambda r: items[r.item].model_id):
            return self.model.pass_weights()
        return contextlib.nullcontext()

    def _run_measured(self, mb: list[Row], *args) -> None:
        """:meth:`_run_micro_batch`, its peak memory per padded token fed to the budget (CUDA)."""
        if self.budget is None:
            return self._run_micro_batch(mb, *args)
        tokens, grad = padded_tokens(mb), any(r.grad for r in mb)
        self.budget.start()
        self._run_micro_batch(mb, *args)
        self.budget.finish(tokens, grad)

    def _shrink_micro_batches(self, rows: list[Row], failed: list[Row], oom: str) -> bool:
        """After a CUDA out-of-memory in micro-batch ``failed``: plan the next try with at most
        half its padded tokens (CUDA: the budget's bytes per token go up, so later passes plan
        from it too; without a budget: ``max_tokens`` is halved below the largest micro-batch of
        ``rows``, for good); False when that batch is already a single row (nothing left to
        split).

        Activation memory grows with the tokens in one micro-batch (every layer keeps its inputs
        for backward), so a cap that fits SFT's 8 x 1,024 tokens can overflow an RL pass of
        8 runs x 16 samples on a GPU the trainer shares with the sampler."""
        if self.budget is not None and failed:
            if len(failed) <= 1:
                return False
            self.budget.out_of_memory(padded_tokens(failed), any(r.grad for r in failed))
            return True
        biggest = max(self._micro_batches(rows), key=lambda mb: len(mb) * mb[0].n)
        if len(biggest) <= 1:
            return False
        self.max_tokens = max(1, (len(biggest) * biggest[0].n) // 2)
        log.warning("CUDA out of memory in a pass of %d rows (%s): micro-batches now at most %d padded tokens",
                    len(rows), oom, self.max_tokens)
        return True

    def _after_oom(self, items, results, valid, rows, oom: str) -> list[FwdBwdResult]:
        """A pass ran out of GPU memory with micro-batches of one row (gradients already
        restored): run each request alone, so only a request too big by itself fails (with a
        message saying so) and the others' results are as if packed."""
        torch.cuda.empty_cache()
        if len(valid) > 1:
            for i in valid:
                results[i] = self.forward_backward([items[i]])[0]
            return results
        tokens = sum(r.n for r in rows)
        free, total = torch.cuda.mem_get_info(self.device) if self.device.type == "cuda" else (0, 0)
        err = ServerError(
            f"CUDA out of memory running this forward_backward ({len(rows)} datums, {tokens} tokens) on "
            f"{self.device} ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free after the failure): send fewer or "
            f"shorter datums per request, or give the trainer more GPU memory (openrl serve --trainer-gpu-memory). "
            f"Nothing was applied; the trainer keeps serving. ({oom})")
        for i in valid:
            results[i] = FwdBwdResult(error=err)
        return results

    def _micro_batch_logprobs(self, mb: list[Row], items: Sequence[FwdBwdItem],
                              needs_grad: bool) -> tuple[list[Row], torch.Tensor]:
        """Target logprobs of one micro-batch: ``(rows, lp)``, the rows reordered so each run's
        rows sit next to each other (the LoRA layers then work on slices) and ``lp`` float32
        ``[B, T, K]`` in that order (K: the widest row's targets per position). With
        ``needs_grad`` the forward keeps its graph for the runs whose rows train. An empty ``mb``
        runs one pad token with no adapter (B = 1): a rank of the distributed engine with no rows
        keeps its collectives in step."""
        with record_function("openrl.trainer.batch"):
            mb, ids, mask, tgt, row_adapters, no_grad_adapters = self._pad_micro_batch(mb, items)
        with torch.set_grad_enabled(needs_grad), record_function("openrl.trainer.forward"):
            lp = target_logprobs(self.model, ids, tgt, mask, row_adapters,
                                 no_grad_adapters=no_grad_adapters, chunk_tokens=self.chunk_tokens,
                                 fused_head=self.fused_head)
        return mb, lp

    def _pad_micro_batch(self, mb: list[Row], items: Sequence[FwdBwdItem]):
        """``(rows, ids [B, T] int64, mask [B, T], targets [B, T, K] int64, row adapters, no-grad
        adapters)`` of one micro-batch, its rows grouped by run (see :meth:`_micro_batch_logprobs`)."""
        first_seen: dict[str, int] = {}
        for r in mb:
            first_seen.setdefault(items[r.item].model_id, len(first_seen))
        mb = sorted(mb, key=lambda r: first_seen[items[r.item].model_id])
        row_adapters: list[str | None] = [items[r.item].model_id for r in mb]
        grad_adapters = {a for a, r in zip(row_adapters, mb) if r.grad}
        no_grad_adapters = sorted(set(row_adapters) - grad_adapters)
        if mb:
            ids, mask = pad_batch([r.tokens.tolist() for r in mb], self.pad_id, side="right")
        else:
            ids, mask = pad_batch([[self.pad_id]], self.pad_id, side="right")
            row_adapters = [None]
        T, K = ids.shape[1], max([r.k for r in mb] + [1])
        tgt = torch.zeros((ids.shape[0], T, K), dtype=torch.long)
        for b, r in enumerate(mb):
            tt = r.inputs["target_tokens"].cpu()
            if tt.dim() == 1:
                tgt[b, : r.n, 0] = tt
            else:
                tgt[b, : r.n, : tt.shape[1]] = tt
        return mb, ids, mask, tgt, row_adapters, no_grad_adapters

    def _run_micro_batch(
        self,
        mb: list[Row],
        items: Sequence[FwdBwdItem],
        configs: Mapping[int, dict[str, float]],
        results: list[FwdBwdResult],
        loss_sums: dict[int, float],
        mismatch: dict[int, MismatchStats],
    ) -> None:
        needs_grad = any(r.grad for r in mb)
        mb, lp = self._micro_batch_logprobs(mb, items, needs_grad)
        total = None
        row_losses: list[torch.Tensor] = []
        row_outputs: list[dict[str, torch.Tensor]] = []
        with torch.set_grad_enabled(needs_grad), record_function("openrl.trainer.loss_rows"):
            for b, r in enumerate(mb):
                step = row_step(lp, b, r, items[r.item].loss_fn, configs[r.item])
                losses.merge_metrics(results[r.item].metrics, step.metrics)
                row_losses.append(step.loss.detach())
                row_outputs.append(step.outputs)
                if step.sampled is not None:
                    mismatch[r.item].add(step.logprobs, *step.sampled)
                if r.grad:
                    total = step.loss if total is None else total + step.loss
            self._read_rows(mb, items, row_losses, row_outputs, results, loss_sums)
        if total is not None and total.requires_grad:
            with record_function("openrl.trainer.backward"):
                total.backward()

    @staticmethod
    def _read_rows(mb: list[Row], items: Sequence[FwdBwdItem], row_losses: list[torch.Tensor],
                   row_outputs: list[dict[str, torch.Tensor]], results: list[FwdBwdResult],
                   loss_sums: dict[int, float]) -> None:
        """The micro-batch's per-datum losses (0-dim) and ``loss_fn_outputs`` (e.g. logprobs
        [T] / [T, K]) to the host in one transfer (per datum, the host would wait for the GPU
        each time), as float32 numpy arrays into ``results``; the losses summed per request into
        ``loss_sums``.

        Raises:
            FloatingPointError: a datum's loss is not finite (before any backward of the
                micro-batch: the caller restores the gradients).
        """
        parts = [loss.reshape(1).to(torch.float32) for loss in row_losses]
        parts += [v.detach().reshape(-1).to(torch.float32) for o in row_outputs for v in o.values()]
        flat = torch.cat(parts).to("cpu").numpy() if parts else np.zeros(0, np.float32)
        n = len(row_losses)
        for b, r in enumerate(mb):
            if not math.isfinite(float(flat[b])):
                raise FloatingPointError(f"non-finite loss for {items[r.item].model_id} datum {r.datum}")
        at = n
        for b, r in enumerate(mb):
            out = {}
            for k, v in row_outputs[b].items():
                out[k] = flat[at: at + v.numel()].reshape(tuple(v.shape)).copy()
                at += v.numel()
            results[r.item].loss_fn_outputs[r.datum] = out
            loss_sums[r.item] += float(flat[b])

    # --------------------------------------------------------------- optimizer

    def optim_step(self, model_id: str, adam: Mapping[str, object] | AdamConfig) -> dict[str, float]:
        """One AdamW step of run ``model_id`` on its accumulated gradients, then zero them.

        Args:
            adam: Tinker ``AdamParams`` fields (learning_rate, beta1, beta2, eps,
                weight_decay, grad_clip_norm); missing ones take the SDK defaults.

        Returns:
            metrics ``{"grad_norm:mean": pre-clip global grad norm, "learning_rate:mean": lr}``.

        Raises:
            NotFound: unknown run. UserError: ``adam_params.<key>`` invalid.
        """
        run = self._run(model_id)
        cfg = adam if isinstance(adam, AdamConfig) else AdamConfig.parse(adam)
        return run.optimizer.step(cfg)

    def optim_step_many(
        self, steps: Sequence[tuple[str, Mapping[str, object] | AdamConfig]]
    ) -> list[dict[str, float] | Exception]:
        """One AdamW step for each of several runs as one fused multi-tensor update
        (:func:`functions.trainer.optim.step_many`); each run keeps its own ``AdamParams``.

        Args:
            steps: ``(model_id, adam params)``, at most one per run.

        Returns:
            per step, in order: its metrics (as :meth:`optim_step`), or the ``NotFound`` /
            ``UserError`` of an invalid step (that run is not stepped; the others are).
        """
        out: list[dict[str, float] | Exception | None] = [None] * len(steps)
        valid: list[tuple[int, RunOptimizer, AdamConfig]] = []
        for i, (model_id, adam) in enumerate(steps):
            try:
                run = self._run(model_id)
                valid.append((i, run.optimizer, adam if isinstance(adam, AdamConfig) else AdamConfig.parse(adam)))
            except (NotFound, UserError) as e:
                out[i] = e
        if valid:
            for (i, _, _), m in zip(valid, step_many([(opt, cfg) for _, opt, cfg in valid])):
                out[i] = m
        return out  # type: ignore[return-value]

    def zero_grad(self, model_id: str) -> None:
        self._run(model_id).optimizer.zero_grad()


__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "OPTIMIZER_NAME",
    "RUN_NAME",
    "Datum",
    "FwdBwdItem",
    "FwdBwdResult",
    "TrainerEngine",
]
