"""The trainer engine on N devices of one node: FSDP2 for the frozen base, data parallel over datums.

:class:`DistributedTrainerEngine` is a :class:`~functions.trainer.engine.TrainerEngine` whose
base model is sharded with PyTorch's own FSDP2 (``torch.distributed.fsdp.fully_shard``) over
a process group of ``world`` ranks (NCCL on CUDA, one GPU per rank; gloo on CPU, one process
per rank), and whose packed passes run data parallel over the datums (rows):

* **Sharding.** Every decoder layer (``base.base_model.layers[i]``) is one FSDP unit and the
  decoder (embeddings, final norm, rotary buffers) the root unit; their frozen weights are
  sharded ``1/world`` per rank and all-gathered layer by layer around forward and backward.
  The unembedding (``lm_head``) stays replicated (a tied one is untied into a copy first), as
  the vocabulary projection is called outside the decoder's forward. The LoRA adapters live in
  plain dicts of :class:`~openrl.model.lora.MultiLoRALinear` (not registered parameters), so
  FSDP never sees them: each run's adapter and its AdamW state are **replicated** on every
  rank, updated by identical ``optim_step`` arithmetic on identical, all-reduced gradients.
* **Data parallel.** Every rank holds the same requests (rank 0 broadcasts each call) and
  computes the same plan of packed micro-batches (``TrainerEngine._micro_batches`` with
  ``max_rows * world`` rows and ``max_tokens * world`` padded tokens); rank ``r`` runs rows
  ``r, r + world, ...`` of each (length-sorted) micro-batch. A rank with no row runs a dummy
  one-token row, and a rank without a gradient row in a micro-batch that has one runs a
  zero-weighted backward, so every rank issues the same FSDP all-gathers in the same order.
  The decoder's input embeddings are marked ``requires_grad`` (as ``transformers``'
  ``enable_input_require_grads``), so every layer's backward runs on every rank whatever the
  runs' LoRA targets. After the pass the new gradients of every run that trained are summed
  over ranks (one flat ``all_reduce``; the loss is a sum over datums, as on one device) and
  added to what the run had accumulated. Losses, logprobs, metrics and mismatch inputs go to
  rank 0 (``gather_object``) and are put back in request order.
* **Commands.** Rank 0 is the trainer function's own engine; ranks 1..N-1 are processes it
  spawns (:func:`launch`), each looping in :func:`follower_loop`: rank 0 broadcasts every
  state-changing call (``create_run``, ``delete_run``, ``forward_backward``, ``optim_step``,
  ``optim_step_many``, ``zero_grad``, ``load_state``, ``load_state_dict``) over a gloo control
  group, then all ranks run it. Read-only calls (``state_dict``, ``save_state``,
  ``sampler_snapshot``, ...) run on rank 0 alone: its adapters are the run's. An optimizer
  step first broadcasts rank 0's gradients of its runs, so gradients written on rank 0 alone
  (``functions.trainer.durable`` restoring a run's unstepped gradients) are the ones stepped.

Limits (see docs/multi-gpu.md): one distributed engine per process (it uses the default
process group); no out-of-memory retry: an exception other than a non-finite loss on one rank
(a CUDA OOM) leaves the others waiting in a collective until the group's timeout, after
which the engine must be rebuilt.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from functions.trainer import losses
from functions.trainer.engine import FwdBwdItem, FwdBwdResult, TrainerEngine
from functions.trainer.mismatch import MismatchStats
from functions.trainer.rows import Row, plan_micro_batches, row_step
from openrl.errors import ServerError
from openrl.model.lora import LoraSpec, PreparedAdapter
from openrl.model.logprobs import DEFAULT_CHUNK_TOKENS

log = logging.getLogger(__name__)

#: calls rank 0 forwards to the other ranks (each runs the same method locally).
REPLICATED_CALLS = ("create_run", "delete_run", "forward_backward", "optim_step", "optim_step_many",
                    "zero_grad", "load_state", "load_state_dict")
_CLOSE = "__close__"


def distributed_available() -> str | None:
    """None if ``torch.distributed`` with gloo is usable here, else the reason it is not."""
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend in this torch build"
    return None


def shard_base(base: nn.Module, mesh, device: torch.device) -> None:
    """Freeze ``base`` (a ``transformers`` causal LM) and apply FSDP2 to its decoder.

    Each ``base.base_model.layers[i]`` becomes one ``fully_shard`` unit, then the decoder
    (``base.base_model``: embeddings, final norm) the root unit; their parameters become
    ``DTensor`` shards on ``mesh``'s device (``device``, this rank's). The output embedding stays a plain, replicated
    parameter (cloned first when tied to the input embedding) moved to that device. A forward
    hook marks the input embeddings' output ``requires_grad`` (see the module docstring).

    Call it before :class:`~openrl.model.lora.MultiLoRAModel` wraps ``base`` (the LoRA
    surgery keeps each ``nn.Linear`` object, so the FSDP units stay valid).

    Raises:
        ValueError: the decoder has no ``layers`` list (not a decoder-only HF model).
    """
    from torch.distributed.fsdp import fully_shard

    for p in base.parameters():
        p.requires_grad_(False)
    decoder = base.base_model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(decoder).__name__} has no decoder `layers` to shard")
    emb, head = base.get_input_embeddings(), base.get_output_embeddings()
    _untie(base)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(decoder, mesh=mesh)
    if head is not None and not head.weight.is_meta:  # a meta model is moved by to_empty later
        head.to(device)
    emb.register_forward_hook(lambda _m, _i, out: out.requires_grad_(True) if torch.is_grad_enabled() else None)


def _untie(base: nn.Module) -> None:
    """Give a tied output embedding its own (frozen) copy of the input embedding's weight."""
    emb, head = base.get_input_embeddings(), base.get_output_embeddings()
    if head is not None and emb is not None and head.weight is emb.weight:
        head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=False)


class DistributedTrainerEngine(TrainerEngine):
    """A :class:`TrainerEngine` sharded over the default process group (module docstring).

    Build one per rank with :meth:`build` (or all at once with :func:`launch`); on rank 0 use
    it as a ``TrainerEngine``; ranks > 0 run :func:`follower_loop`.

    Attributes:
        rank, world: this process's rank and the group's size.
    """

    rank: int
    world: int
    _control: Any
    _followers: list

    @classmethod
    def build(cls, base_model_dir: Path, *, dtype: torch.dtype = torch.float32, max_rows: int = 64,
              max_tokens: int = 32768, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
              fused_kernels: bool | None = None, control_group=None) -> "DistributedTrainerEngine":
        """Load ``base_model_dir``, shard it on this rank's device (``cuda:<local rank>`` when
        the default group is NCCL, else CPU), wrap it as the trainer engine. Only rank 0 reads
        the checkpoint (on CPU); the other ranks build the model on the meta device and get
        their shards (``set_model_state_dict(..., broadcast_from_rank0=True)``) and the
        buffers from rank 0.

        Must be called by every rank of the initialised default process group, together.

        Args:
            max_rows, max_tokens: per-rank micro-batch limits (as ``TrainerEngine``'s).
            control_group: the gloo group rank 0 broadcasts calls over (:func:`init_groups`).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoConfig, AutoModelForCausalLM

        rank, world = dist.get_rank(), dist.get_world_size()
        cuda = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        # only rank 0 reads the checkpoint (host memory: one copy of the model, not one per rank);
        # the others build it on the meta device and receive their shards from rank 0
        if rank == 0:
            base = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=dtype)
            _untie(base)
            full = dict(base.state_dict())
        else:
            with torch.device("meta"):
                base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(base_model_dir)), dtype=dtype)
            full = {}
        shard_base(base, init_device_mesh(device.type, (world,)), device)
        if rank != 0:
            base.to_empty(device=device)
        set_model_state_dict(base, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
        for buf in base.buffers():  # non-persistent ones (rotary inv_freq) are in no state dict
            dist.broadcast(buf, src=0)
        self = cls.__new__(cls)
        self.rank, self.world, self._control, self._followers = rank, world, control_group, []
        self._setup(base, Path(base_model_dir), device, max_rows, max_tokens, chunk_tokens, fused_kernels)
        return self

    # ------------------------------------------------------------- commands

    def _send(self, name: str, *args) -> None:
        """Rank 0: broadcast the call to the followers (which run the same method, where this
        is a no-op)."""
        if self.rank == 0 and self.world > 1:
            dist.broadcast_object_list([(name, args)], src=0, group=self._control)

    def create_run(self, model_id: str, spec: LoraSpec, prepared: PreparedAdapter | None = None) -> None:
        """As ``TrainerEngine.create_run``; a missing seed is drawn here (or taken from
        ``prepared``, whose seed :meth:`prepare_run` resolved), so every rank's adapter is
        initialised the same."""
        if prepared is not None:
            spec = prepared.spec
        elif spec.seed is None:
            spec = replace(spec, seed=secrets.randbits(63))
        self._send("create_run", model_id, spec)
        super().create_run(model_id, spec, prepared)

    def delete_run(self, model_id: str) -> None:
        self._send("delete_run", model_id)
        super().delete_run(model_id)

    def forward_backward(self, items: Sequence[FwdBwdItem]) -> list[FwdBwdResult]:
        """As ``TrainerEngine.forward_backward``, data parallel over the ranks; the results
        are rank 0's (other ranks return placeholders)."""
        self._send("forward_backward", list(items))
        return super().forward_backward(items)

    def optim_step(self, model_id, adam):
        """As ``TrainerEngine.optim_step``, on rank 0's gradients (:meth:`_sync_grads`)."""
        self._send("optim_step", model_id, adam)
        self._sync_grads([model_id])
        return super().optim_step(model_id, adam)

    def optim_step_many(self, steps):
        """As ``TrainerEngine.optim_step_many``, on rank 0's gradients (:meth:`_sync_grads`)."""
        steps = list(steps)
        self._send("optim_step_many", steps)
        self._sync_grads([m for m, _ in steps])
        return super().optim_step_many(steps)

    def _sync_grads(self, model_ids: Sequence[str]) -> None:
        """Give every rank rank 0's accumulated gradients of these runs (one flat broadcast;
        unknown runs skipped). After a pass they are equal anyway; this makes gradients put on
        rank 0 alone (``durable``'s restore of a run's unstepped gradients) count on all ranks."""
        if self.world == 1:
            return
        params = [p for m in dict.fromkeys(model_ids) if m in self.runs for p in self.runs[m].optimizer.params]
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in params])
        dist.broadcast(flat, src=0)
        off = 0
        for p in params:
            n = p.numel()
            p.grad = flat[off : off + n].view_as(p).to(p.dtype).clone()
            off += n

    def zero_grad(self, model_id: str) -> None:
        self._send("zero_grad", model_id)
        super().zero_grad(model_id)

    def load_state(self, model_id, directory, with_optimizer, spec=None) -> None:
        """As ``TrainerEngine.load_state``; every rank reads ``directory`` (one node: one
        filesystem)."""
        self._send("load_state", model_id, str(directory), with_optimizer, spec)
        super().load_state(model_id, directory, with_optimizer, spec)

    def load_state_dict(self, model_id, state, with_optimizer) -> None:
        self._send("load_state_dict", model_id, state, with_optimizer)
        super().load_state_dict(model_id, state, with_optimizer)

    def close(self) -> None:
        """Rank 0: stop the followers, wait for their processes, leave the process group."""
        if self.rank == 0 and self.world > 1:
            self._send(_CLOSE)
        for p in self._followers:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        self._followers = []
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ passes

    def _global_micro_batches(self, rows: list[Row]) -> list[list[Row]]:
        """The pass's micro-batches over all ranks: each rank's caps times the world size (a
        rank then takes every world-th row of each)."""
        return plan_micro_batches(rows, self.max_rows * self.world, self.max_tokens * self.world)

    def _forward_backward(self, items: Sequence[FwdBwdItem]) -> list[FwdBwdResult]:
        results, configs, all_rows = self._prepare_all(items)  # every rank finds the same errors
        valid = [i for i in range(len(items)) if results[i].error is None]
        if not all_rows:
            return results
        grad_runs = sorted({items[r.item].model_id for r in all_rows if r.grad})
        params = [p for m in grad_runs for p in self.runs[m].optimizer.params]
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        done: list[tuple] = []  # (item, datum, outputs, loss, metrics, mismatch inputs) of this rank's rows
        error = None
        plan = self._global_micro_batches(all_rows)
        with self._pass_weights(plan, items):  # the replicated adapters cast once for the pass
            for mb in plan:
                needs_grad = any(r.grad for r in mb)
                mine = mb[self.rank :: self.world]
                try:
                    self._run_slice(mine, needs_grad, items, configs, done)
                except FloatingPointError as e:  # raised after the backward: the ranks are in step, go on
                    error = error or f"{type(e).__name__}: {e}"
                except Exception as e:  # noqa: BLE001 - same inputs on every rank: they all fail here alike
                    error = error or f"{type(e).__name__}: {e}"
                    break
        flat = self._reduce_grads(params, failed=error is not None)
        gathered: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object((done, error), gathered, dst=0)
        if flat is None:  # some rank failed: restore every run's gradients, fail every valid item
            for p, g in zip(params, before):
                p.grad = g
            msg = "; ".join(e for _, e in (gathered or []) if e) or "failed on another rank"
            err = ServerError(f"forward_backward pass failed: {msg}")
            for i in valid:
                results[i] = FwdBwdResult(error=err)
            return results
        for p, g in zip(params, before):
            if g is not None:
                p.grad = g + p.grad
        if self.rank != 0:
            return results
        rows = sorted((row for rank_rows, _ in gathered for row in rank_rows), key=lambda x: (x[0], x[1]))
        for i in valid:
            results[i].loss_fn_outputs = [{} for _ in items[i].datums]
            results[i].metrics = {"loss:sum": 0.0}
        mismatch = {i: MismatchStats() for i in valid}
        for i, j, outputs, loss, metrics, sampled in rows:
            results[i].loss_fn_outputs[j] = outputs
            results[i].metrics["loss:sum"] += loss
            losses.merge_metrics(results[i].metrics, metrics)
            if sampled is not None:
                mismatch[i].add(*sampled)
        for i in valid:
            if not mismatch[i].empty:
                results[i].metrics.update(mismatch[i].metrics())
                results[i].mismatch = mismatch[i]
        return results

    def _reduce_grads(self, params: list[nn.Parameter], failed: bool) -> torch.Tensor | None:
        """Sum this pass's gradients of ``params`` over the ranks (one flat all_reduce, with a
        failure count appended); None when any rank failed (grads then left unreduced)."""
        device = self.device
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params]
        flat = torch.cat(parts + [torch.tensor([float(failed)], device=device)])
        dist.all_reduce(flat)
        if float(flat[-1]) > 0:
            return None
        off = 0
        for p in params:
            n = p.numel()
            p.grad = flat[off : off + n].view_as(p).to(p.dtype).clone()
            off += n
        return flat

    def _run_slice(self, mb: list[Row], needs_grad: bool, items: Sequence[FwdBwdItem],
                   configs: dict[int, dict[str, float]], done: list[tuple]) -> None:
        """Forward (and backward when ``needs_grad``, the same on every rank) of this rank's
        rows of one micro-batch; appends each row's results to ``done``.

        Raises:
            FloatingPointError: a row's loss is not finite (after the backward, so the ranks
                stay in step; that row's loss is left out of it).
        """
        mb, lp = self._micro_batch_logprobs(mb, items, needs_grad)
        bad = None
        with torch.set_grad_enabled(needs_grad):
            total = lp.sum() * 0.0 if needs_grad else None  # every rank runs the backward
            for b, r in enumerate(mb):
                step = row_step(lp, b, r, items[r.item].loss_fn, configs[r.item])
                if not torch.isfinite(step.loss.detach()):
                    bad = bad or f"non-finite loss for {items[r.item].model_id} datum {r.datum}"
                    continue
                sampled = step.sampled
                done.append((r.item, r.datum,
                             {k: v.detach().to("cpu", torch.float32).numpy() for k, v in step.outputs.items()},
                             float(step.loss.detach()), step.metrics,
                             None if sampled is None else (step.logprobs.detach().cpu(), *(t.cpu() for t in sampled))))
                if r.grad:
                    total = total + step.loss
            if needs_grad:
                total.backward()
        if bad:
            raise FloatingPointError(bad)


# ---------------------------------------------------------------------- launching


def init_groups(rank: int, world: int, init_method: str, backend: str = "gloo",
                timeout_s: float = 1800.0):
    """Join the default process group (``backend``) and make the gloo control group rank 0
    broadcasts calls over (it waits idle between requests, so its timeout is long).

    Returns:
        the control group.
    """
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return dist.new_group(backend="gloo", timeout=timedelta(days=365))


def follower_loop(engine: DistributedTrainerEngine) -> None:
    """Ranks > 0: run every call rank 0 broadcasts until it closes the group. A call that
    raises here raised on rank 0 too (same inputs, same checks); it is logged and skipped."""
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=engine._control)
        name, args = box[0]
        if name == _CLOSE:
            break
        if name not in REPLICATED_CALLS:
            log.error("rank %d: unknown call %r from rank 0 (ignored)", engine.rank, name)
            continue
        try:
            getattr(engine, name)(*args)
        except Exception as e:  # noqa: BLE001 - rank 0 reports it
            log.debug("rank %d: %s failed: %s", engine.rank, name, e)
    dist.destroy_process_group()


def _follower_main(rank: int, world: int, init_method: str, backend: str, timeout_s: float,
                   base_model_dir: str, kwargs: dict) -> None:
    torch.set_num_threads(max(1, int(kwargs.pop("threads", 1))))
    control = init_groups(rank, world, init_method, backend, timeout_s)
    engine = DistributedTrainerEngine.build(Path(base_model_dir), control_group=control, **kwargs)
    follower_loop(engine)


def launch(base_model_dir: Path, world: int, *, backend: str | None = None, timeout_s: float = 1800.0,
           threads: int | None = None, **engine_kwargs) -> DistributedTrainerEngine:
    """Start a ``world``-rank trainer engine: this process becomes rank 0 (the returned
    engine), ``world - 1`` spawned processes the others (:func:`follower_loop`).

    Args:
        base_model_dir: the Hugging Face model directory every rank loads.
        world: ranks (GPUs with NCCL, processes with gloo), >= 1.
        backend: "nccl" or "gloo"; None: NCCL when CUDA has ``world`` devices, else gloo.
        timeout_s: collective timeout of the data-plane group (a hung rank surfaces as an
            error after this long).
        threads: torch CPU threads per follower (None: this process's count).
        engine_kwargs: ``dtype``, ``max_rows``, ``max_tokens``, ``chunk_tokens``,
            ``fused_kernels`` (as :meth:`DistributedTrainerEngine.build`).

    Raises:
        ValueError: ``world`` < 1, or NCCL asked for with fewer CUDA devices than ``world``.
        RuntimeError: a process group is already initialised in this process.
    """
    import torch.multiprocessing as mp

    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"{world} ranks asked for, {torch.cuda.device_count()} CUDA devices present")
    fd, store = tempfile.mkstemp(prefix="openrl-trainer-pg-")
    os.close(fd)
    os.unlink(store)  # the file store creates it
    init_method = f"file://{store}"
    ctx = mp.get_context("spawn")
    kw = dict(engine_kwargs, threads=threads or torch.get_num_threads())
    followers = [ctx.Process(target=_follower_main, daemon=True,
                             args=(r, world, init_method, backend, timeout_s, str(base_model_dir), dict(kw)))
                 for r in range(1, world)]
    for p in followers:
        p.start()
    try:
        control = init_groups(0, world, init_method, backend, timeout_s)
        engine = DistributedTrainerEngine.build(Path(base_model_dir), control_group=control, **engine_kwargs)
    except BaseException:
        for p in followers:
            p.kill()
        raise
    engine._followers = followers
    return engine


__all__ = ["DistributedTrainerEngine", "REPLICATED_CALLS", "distributed_available", "follower_loop",
           "init_groups", "launch", "shard_base"]
