"""Co-batched multi-LoRA training on one GPU: our TrainerEngine on Qwen3-4B shapes.

    python bench/cobatch_h200.py [--out DIR] [--tiny] [--reps 5] [--sections a,b,...]

Model: Qwen3-4B shapes (36 layers, hidden 2560, MLP 9728, 32 query / 8 KV heads of 128,
vocab 151,936, tied embeddings), random bf16 weights, SDPA attention; LoRA rank 32, alpha 32
on q/k/v/o/gate/up/down (``train_unembed=False``), as ``bench/peft_baseline_h200.py`` (the
transformers + peft baseline, run in the same job). Every step is one
``TrainerEngine.forward_backward`` call with the RL loss (``importance_sampling``: target
tokens, sampling logprobs, advantages), timed between ``torch.cuda.synchronize()`` calls;
gradients are cleared between steps outside the timed region (what ``optim_step`` does).
Median of ``--reps`` steps after 2 warm-up steps.

Sections (``--sections``, default all):
  check     optimised vs "before" paths on the GPU: relative error of logprobs and gradients
  cobatch   N = 1, 2, 4, 8 runs x (1 x 1024 tokens): one co-batched pass vs N passes one
            after another (our engine), plus the "before" configuration at N = 1 and 8
  ablate    N = 8 co-batched with one optimisation switched off at a time
  full      one run, 8 x 1024 tokens: tokens/s, MFU, peak memory (optimised and "before")
  big       one run, 16 x 1024 and 32 x 1024 (micro-batches of at most --max-tokens)
  ragged    8 runs x 1 sequence of 256..1024 tokens (right-padded batch)
  optim     optim_step of 8 runs, one after another
  profile   torch.profiler table of one 8-run co-batched step (profile_cobatch8.txt)
  rl        the stack's RL step on the trainer (N = 1, 8 runs x 16 datums x 191 tokens): forward_backward,
            optim_step_many, snapshot packing, per-row cost, micro-batch caps, profiles (--rl-profile; profile_rl_RUNS_CAP.txt)

Configurations: "optimised" = grouped-GEMM multi-LoRA (the model's ``LoraKernelSettings(mode=
"auto")``), fused logprob head (``TrainerEngine.fused_head``), compiled pointwise kernels
(``openrl.model.kernels.accelerate_model``, ``set_fused_kernels``); "before" = stacked row-masked LoRA, the
checkpointed two-pass logprob head, eager pointwise code (the engine as it was measured
before this work: 8 runs 622 ms, one adapter 550 ms per 8192 tokens).

MFU = (4 * N_non-embedding * tokens + 4 * hidden * vocab * tokens) / time / peak, with the
peak measured here (bf16 8192^3 matmul), the formula of ``../shared/reference/
h200-baselines.md``: forward + input gradients of the frozen body, LM head forward +
backward-input; LoRA and attention FLOPs are not counted.

Output: one JSON line per measurement on stdout and in ``DIR/cobatch.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

OUT: Path | None = None


def log(**kw) -> None:
    line = json.dumps(kw, default=str)
    print(line, flush=True)
    if OUT is not None:
        with open(OUT / "cobatch.jsonl", "a") as f:
            f.write(line + "\n")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_peak(dev: str) -> float | None:
    """Measured bf16 matmul rate (FLOP/s), as in peft_baseline_h200.py."""
    if dev != "cuda":
        return None
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    sync()
    dt = (time.perf_counter() - t) / 20
    del a, b
    return 2 * 8192**3 / dt


def build_model(tiny: bool, dev: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if tiny:
        cfg = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                          tie_word_embeddings=True)
    else:
        cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                          rope_theta=1_000_000, tie_word_embeddings=True)
    cfg._attn_implementation = os.environ.get("ATTN", "sdpa")
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    with torch.device(dev):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    return model, cfg


class Bench:
    def __init__(self, args):
        from functions.trainer.engine import TrainerEngine
        from openrl.model.lora import LoraSpec

        self.args = args
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dev == "cuda" and args.gpu_memory:  # the embedded stack's trainer share (functions/trainer/function.py)
            torch.cuda.set_per_process_memory_fraction(float(args.gpu_memory), torch.cuda.current_device())
            log(what="gpu_memory_fraction", value=float(args.gpu_memory),
                gb=round(float(args.gpu_memory) * torch.cuda.get_device_properties(0).total_memory / 1e9, 1))
        self.T = 64 if args.tiny else 1024
        self.rank = 8 if args.tiny else 32
        self.peak = matmul_peak(self.dev)
        log(what="bf16_matmul_peak_tflops", value=None if self.peak is None else self.peak / 1e12)
        t0 = time.time()
        model, cfg = build_model(args.tiny, self.dev)
        self.cfg = cfg
        n_params = sum(p.numel() for p in model.parameters())
        self.n_nonembed = n_params - model.model.embed_tokens.weight.numel()
        self.engine = TrainerEngine.from_base_model(model, device=self.dev, max_rows=64, max_tokens=args.max_tokens,
                                                    chunk_tokens=args.chunk_tokens, name="random-qwen3-4b")
        log(what="setup", params=n_params, non_embedding=self.n_nonembed, attn=cfg._attn_implementation,
            kernels=self.engine.kernels, build_s=round(time.time() - t0, 1), torch=torch.__version__,
            device=torch.cuda.get_device_name(0) if self.dev == "cuda" else "cpu")
        self.runs = [f"run{i}" for i in range(8)]
        g = torch.Generator(device="cpu").manual_seed(42)
        for i, r in enumerate(self.runs):
            self.engine.create_run(r, LoraSpec(rank=self.rank, alpha=32, seed=i, train_unembed=False))
            with torch.no_grad():  # B != 0, so every adapter changes the outputs
                for name, p in self.engine.model.named_adapter_parameters(r):
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        self.rng = np.random.RandomState(0)
        from openrl.model import kernels

        self.kernels = kernels

    # -------------------------------------------------------------- configurations

    def config(self, name: str) -> None:
        """'optimised' | 'before' | 'no_grouped' | 'no_fused_head' | 'no_compile'."""
        from openrl.model.lora import LoraKernelSettings

        grouped = name not in ("before", "no_grouped")
        self.engine.model.kernel_settings = LoraKernelSettings(mode="auto" if grouped else "stacked")
        self.engine.fused_head = name not in ("before", "no_fused_head")
        self.engine.chunk_tokens = 2048 if name == "before" else self.args.chunk_tokens  # 2048: the old default
        self.kernels.set_fused_kernels(name not in ("before", "no_compile"))

    # -------------------------------------------------------------- data

    def item(self, run: str, rows: int, T: int | None = None, lengths: list[int] | None = None):
        from functions.trainer.engine import Datum, FwdBwdItem

        V = self.cfg.vocab_size
        datums = []
        for j in range(rows):
            n = lengths[j] if lengths else (T or self.T)
            ids = self.rng.randint(0, V, size=n + 1).astype(np.int64)
            datums.append(Datum(list(ids[:-1]), {
                "target_tokens": ids[1:],
                "logprobs": self.rng.uniform(-12, -8, n).astype(np.float32),
                "advantages": self.rng.normal(size=n).astype(np.float32),
            }))
        return FwdBwdItem(run, datums, "importance_sampling")

    def zero(self) -> None:
        for r in self.runs:
            self.engine.zero_grad(r)

    def step(self, items) -> None:
        res = self.engine.forward_backward(items)
        for x in res:
            if x.error is not None:
                raise RuntimeError(f"forward_backward failed: {x.error}")

    def timed(self, fn, reps: int | None = None, warmup: int = 2) -> dict:
        reps = reps or self.args.reps
        for _ in range(warmup):
            fn()
            self.zero()
        budget = getattr(self.engine, "budget", None)  # it resets torch's peak per micro-batch
        if budget is not None:
            budget.reset_peak()
        elif self.dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
            self.zero()
        out = {"s_median": statistics.median(times), "s_min": min(times), "s_all": [round(x, 4) for x in times]}
        if self.dev == "cuda":
            peak = max(torch.cuda.max_memory_allocated(), budget.peak_allocated if budget is not None else 0)
            out["peak_mem_gb"] = round(peak / 1e9, 1)
        return out

    def mfu(self, tokens: int, seconds: float) -> float | None:
        if self.peak is None:
            return None
        H, V = self.cfg.hidden_size, self.cfg.vocab_size
        return (4 * self.n_nonembed * tokens + 4 * H * V * tokens) / seconds / self.peak

    # -------------------------------------------------------------- sections

    def s_check(self) -> None:
        """Optimised vs 'before' on the GPU: logprobs and LoRA gradients of 2 co-batched runs."""
        from openrl.model.logprobs import pad_batch, target_logprobs

        T = min(self.T, 256)
        ids = torch.from_numpy(self.rng.randint(0, self.cfg.vocab_size, size=(3, T + 1)))
        rows = ["run0", "run0", "run1"]
        res = {}
        for name in ("before", "optimised"):
            self.config(name)
            self.zero()
            inp, mask = pad_batch([r[:-1].tolist() for r in ids], 0)
            lp = target_logprobs(self.engine.model, inp, ids[:, 1:], mask, rows)
            w = torch.linspace(-1, 1, lp.numel(), device=lp.device).view_as(lp)
            (lp * w).sum().backward()
            grads = [p.grad.detach().float().clone() for r in ("run0", "run1") for p in self.engine.model.adapter_parameters(r)]
            res[name] = (lp.detach().float(), grads)
        self.zero()
        (la, ga), (lb, gb) = res["before"], res["optimised"]
        lp_err = float((la - lb).norm() / la.norm())
        g_err = float(torch.stack([(a - b).norm() ** 2 for a, b in zip(ga, gb)]).sum().sqrt()
                      / torch.stack([a.norm() ** 2 for a in ga]).sum().sqrt())
        log(what="check_optimised_vs_before", tokens=3 * T, logprob_rel_err=lp_err, grad_rel_err=g_err,
            logprob_max_abs_diff=float((la - lb).abs().max()))

    def s_precision(self) -> None:
        """bf16 paths ('before', 'optimised', each ablation) vs a float32 reference (the same
        weights upcast, eager 'before' code): relative L2 error of logprobs and LoRA grads."""
        from openrl.model.logprobs import pad_batch, target_logprobs

        T = min(self.T, 256)
        ids = torch.from_numpy(self.rng.randint(0, self.cfg.vocab_size, size=(3, T + 1)))
        rows = ["run0", "run0", "run1"]

        def run(name: str, fp32: bool = False):
            self.config(name)
            self.zero()
            orig = next(self.engine.model.base.parameters()).dtype
            if fp32:
                self.engine.model.base.float()
            try:
                inp, mask = pad_batch([r[:-1].tolist() for r in ids], 0)
                lp = target_logprobs(self.engine.model, inp, ids[:, 1:], mask, rows)
                w = torch.linspace(-1, 1, lp.numel(), device=lp.device).view_as(lp)
                (lp * w).sum().backward()
                grads = [p.grad.detach().double().clone() for r in ("run0", "run1")
                         for p in self.engine.model.adapter_parameters(r)]
                return lp.detach().double(), grads
            finally:
                if fp32:
                    self.engine.model.base.to(orig)
                self.zero()

        def rel(a, b):
            la, ga = a
            lr, gr = b
            g = float(sum(((x - y).norm() ** 2 for x, y in zip(ga, gr))) ** 0.5 / sum((y.norm() ** 2 for y in gr)) ** 0.5)
            return float((la - lr).norm() / lr.norm()), g

        ref = run("before", fp32=True)
        out = {}
        for name in ("before", "optimised", "no_grouped", "no_fused_head", "no_compile"):
            out[name] = run(name)
            e_lp, e_g = rel(out[name], ref)
            log(what="precision_vs_fp32", config=name, tokens=3 * T, logprob_rel_err=e_lp, grad_rel_err=e_g)
        e_lp, e_g = rel(out["optimised"], out["before"])
        log(what="precision_optimised_vs_before", logprob_rel_err=e_lp, grad_rel_err=e_g)
        self.config("optimised")

    def s_cobatch(self) -> None:
        T = self.T
        for cfg_name, ns in (("optimised", (1, 2, 4, 8)), ("before", (1, 8))):
            self.config(cfg_name)
            for n in ns:
                runs = self.runs[:n]
                items = [self.item(r, 1) for r in runs]
                co = self.timed(lambda: self.step(items))
                seq = self.timed(lambda: [self.step([it]) for it in items], reps=max(2, self.args.reps // 2))
                tok = n * T
                log(what="cobatch", config=cfg_name, runs=n, tokens_per_run=T, tokens=tok,
                    cobatched_s=round(co["s_median"], 4), cobatched_tokens_per_s=round(tok / co["s_median"]),
                    sequential_s=round(seq["s_median"], 4), sequential_tokens_per_s=round(tok / seq["s_median"]),
                    speedup_vs_own_sequential=round(seq["s_median"] / co["s_median"], 2),
                    mfu=self.mfu(tok, co["s_median"]), peak_mem_gb=co.get("peak_mem_gb"), detail=co)

    def s_ablate(self) -> None:
        items = [self.item(r, 1) for r in self.runs]
        tok = 8 * self.T
        for name in ("optimised", "no_grouped", "no_fused_head", "no_compile"):
            self.config(name)
            r = self.timed(lambda: self.step(items))
            log(what="ablate_cobatch8", config=name, s=round(r["s_median"], 4), tokens_per_s=round(tok / r["s_median"]),
                peak_mem_gb=r.get("peak_mem_gb"))
        self.config("optimised")

    def s_full(self) -> None:
        for name in ("optimised", "before"):
            self.config(name)
            it = [self.item("run0", 8)]
            r = self.timed(lambda: self.step(it))
            tok = 8 * self.T
            log(what="single_run_8x1024", config=name, s=round(r["s_median"], 4),
                tokens_per_s=round(tok / r["s_median"]), mfu=self.mfu(tok, r["s_median"]), peak_mem_gb=r.get("peak_mem_gb"))
        self.config("optimised")

    def s_big(self) -> None:
        self.config("optimised")
        for rows in (16, 32):
            it = [self.item("run0", rows)]
            try:
                r = self.timed(lambda: self.step(it), reps=3, warmup=1)
                tok = rows * self.T
                log(what=f"single_run_{rows}x{self.T}", config="optimised", s=round(r["s_median"], 4),
                    tokens_per_s=round(tok / r["s_median"]), mfu=self.mfu(tok, r["s_median"]),
                    peak_mem_gb=r.get("peak_mem_gb"), micro_batch_max_tokens=self.args.max_tokens,
                    micro_batches=-(-rows * self.T // self.args.max_tokens))
            except Exception as e:  # OOM
                log(what=f"single_run_{rows}x{self.T}", error=f"{type(e).__name__}: {str(e)[:200]}")
                self.zero()
                if self.dev == "cuda":
                    torch.cuda.empty_cache()

    def s_ragged(self) -> None:
        self.config("optimised")
        lens = [int(x) for x in self.rng.randint(self.T // 4, self.T + 1, size=8)]
        items = [self.item(r, 1, lengths=[n]) for r, n in zip(self.runs, lens)]
        r = self.timed(lambda: self.step(items))
        tok = sum(lens)
        log(what="ragged_8_runs", lengths=lens, real_tokens=tok, padded_tokens=8 * max(lens), s=round(r["s_median"], 4),
            real_tokens_per_s=round(tok / r["s_median"]), peak_mem_gb=r.get("peak_mem_gb"))

    def s_optim(self) -> None:
        self.config("optimised")
        items = [self.item(r, 1) for r in self.runs]
        times = []
        for _ in range(3):
            self.step(items)
            sync()
            t = time.perf_counter()
            for r in self.runs:
                self.engine.optim_step(r, {"learning_rate": 1e-5})
            sync()
            times.append(time.perf_counter() - t)
        log(what="optim_step_8_runs", s_median=round(statistics.median(times), 4), per_run_ms=round(1000 * statistics.median(times) / 8, 1))

    def s_rl(self) -> None:
        """The trainer's work of one RL step of ``bench/stack_h200.py`` (fixed shapes: 4 prompts x 4
        samples, 64 + 128 - 1 = 191 tokens a datum, 16 datums a run, importance_sampling with the
        sampler's logprobs, rank 32, train_unembed=False), N = 1 and 8 runs in one pass, as the
        stack's trainer runs it: forward_backward, optim_step_many of the N runs, the N snapshots
        packed; beside it the same tokens as one long row per run (what per-row work costs), and
        the passes under smaller micro-batch caps (what a cap that fits a shared GPU costs).
        Then one 8-run step under torch.profiler: the engine's ranges (``openrl.trainer.*``:
        prepare, batch, forward, loss_rows, backward, optim, pack) in host milliseconds, the
        device's busy milliseconds, and the host syncs (profile_rl_RUNS_CAP.txt)."""
        self.config("optimised")
        T = 16 if self.args.tiny else 191
        rows = 16
        cap0 = self.engine.max_tokens
        for n in (1, 8):
            runs = self.runs[:n]
            items = [self.item(r, rows, lengths=[T] * rows) for r in runs]
            fb = self.timed(lambda: self.step(items))
            long_items = [self.item(r, 1, lengths=[T * rows]) for r in runs]
            fb_long = self.timed(lambda: self.step(long_items))
            opt, pack = [], []
            for _ in range(3):
                self.step(items)
                sync()
                t = time.perf_counter()
                self.engine.optim_step_many([(r, {"learning_rate": 1e-5}) for r in runs])
                sync()
                opt.append(time.perf_counter() - t)
                t = time.perf_counter()
                snaps = [self.engine.pack_sampler_snapshot(r) for r in runs]
                sync()
                pack.append(time.perf_counter() - t)
                del snaps
            tok = n * rows * T
            log(what="rl_trainer_step", runs=n, datums=n * rows, tokens=tok,
                forward_backward_s=round(fb["s_median"], 4), tokens_per_s=round(tok / fb["s_median"]),
                long_rows_s=round(fb_long["s_median"], 4), long_rows_tokens_per_s=round(tok / fb_long["s_median"]),
                per_row_ms=round(1000 * (fb["s_median"] - fb_long["s_median"]) / (n * rows - n), 2),
                optim_step_many_s=round(statistics.median(opt), 4), pack_s=round(statistics.median(pack), 4),
                peak_mem_gb=fb.get("peak_mem_gb"), long_peak_mem_gb=fb_long.get("peak_mem_gb"))
        budget = getattr(self.engine, "budget", None)
        if budget is not None:  # the cap the memory budget plans for this pass (the default's)
            log(what="rl_trainer_budget", train_cap=budget.cap(True), forward_cap=budget.cap(False),
                mb_per_token=round(budget.bytes_per_token[True] / 1e6, 3), measured=budget.measured[True])
        self.engine.budget = None  # explicit caps alone: what each costs, whatever the memory left
        if self.args.gpu_memory and self.dev == "cuda":
            # under the stack's share: the engine before the budget (one cap for every pass, halved
            # for good by each out-of-memory) on the same 8-run pass, same job
            items = [self.item(r, rows, lengths=[T] * rows) for r in self.runs]
            r = self.timed(lambda: self.step(items), reps=3, warmup=2)
            log(what="rl_trainer_step_no_budget", runs=8, tokens=8 * rows * T, forward_backward_s=round(r["s_median"], 4),
                tokens_per_s=round(8 * rows * T / r["s_median"]), max_tokens_after=self.engine.max_tokens,
                start_max_tokens=cap0, peak_mem_gb=r.get("peak_mem_gb"), s_all=r["s_all"])
            self.engine.max_tokens = cap0
            torch.cuda.empty_cache()
        caps_rows = () if self.args.gpu_memory else ((8, (16384, 8192, 4096, 3056)), (1, (16384,)))
        for n, caps in caps_rows:  # micro-batch caps (the whole GPU only: under a share the big ones run out)
            items = [self.item(r, rows, lengths=[T] * rows) for r in self.runs[:n]]
            for cap in caps:
                self.engine.max_tokens = cap
                r = self.timed(lambda: self.step(items), reps=3, warmup=1)
                log(what="rl_trainer_cap", runs=n, max_tokens=cap, s=round(r["s_median"], 4),
                    tokens_per_s=round(n * rows * T / r["s_median"]), peak_mem_gb=r.get("peak_mem_gb"))
        self.engine.max_tokens = cap0
        self.engine.budget = budget
        for spec in self.args.rl_profile.split(","):  # "runs@cap", e.g. 8@16384
            n, _, cap = spec.partition("@")
            self.engine.max_tokens = int(cap or cap0)
            runs = self.runs[: int(n)]
            self._profile_rl([self.item(r, rows, lengths=[T] * rows) for r in runs], runs, spec)
        self.engine.max_tokens = cap0

    def _profile_rl(self, items, runs, label: str) -> None:
        from torch.profiler import ProfilerActivity, profile, record_function

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dev == "cuda" else [])

        def one() -> None:
            self.step(items)
            with record_function("openrl.trainer.optim"):
                self.engine.optim_step_many([(r, {"learning_rate": 1e-5}) for r in runs])
            with record_function("openrl.trainer.pack"):
                [self.engine.pack_sampler_snapshot(r) for r in runs]
            sync()

        one()
        sync()
        t = time.perf_counter()
        one()
        wall_plain = time.perf_counter() - t
        t = time.perf_counter()
        with profile(activities=acts) as prof:
            one()
        wall = time.perf_counter() - t
        ka = prof.key_averages()
        ranges = {e.key: round(e.cpu_time_total / 1000, 1) for e in ka if e.key.startswith("openrl.trainer.")}
        counts = {e.key: e.count for e in ka if e.key.startswith("openrl.trainer.")}
        dev_ms = sum(getattr(e, "self_device_time_total", 0) or 0 for e in ka
                     if str(getattr(e, "device_type", "")).endswith("CUDA")) / 1000
        if not dev_ms:  # kernels not listed apart: every op's own device time, each kernel counted once
            dev_ms = sum(getattr(e, "self_device_time_total", 0) or 0 for e in ka) / 1000
        syncs = {e.key: {"n": e.count, "cpu_ms": round(e.cpu_time_total / 1000, 1)} for e in ka
                 if e.key in ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                              "aten::to", "aten::_to_copy", "aten::copy_", "cudaMemcpyAsync", "cudaLaunchKernel",
                              "aten::nonzero", "aten::isfinite")}
        gpu_ranges = {e.key: round((getattr(e, "device_time_total", 0) or 0) / 1000, 1) for e in ka
                      if e.key.startswith("openrl.trainer.")}
        log(what="rl_trainer_profile", profile=label, wall_ms=round(1000 * wall_plain, 1),
            wall_ms_profiled=round(1000 * wall, 1), ranges_host_ms=ranges, ranges_gpu_ms=gpu_ranges,
            range_counts=counts, device_busy_ms=round(dev_ms, 1), host_ops=syncs)
        tables = []
        for key in (("self_device_time_total", "self_cuda_time_total") if self.dev == "cuda" else ()) + ("cpu_time_total",):
            try:
                tables.append(f"sorted by {key}\n" + ka.table(sort_by=key, row_limit=40, max_name_column_width=60))
            except Exception:
                continue
        text = "\n\n".join(tables)
        if OUT is not None:
            (OUT / f"profile_rl_{label.replace('@', '_')}.txt").write_text(text)
        print(text[:3000], flush=True)

    def s_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.config("optimised")
        items = [self.item(r, 1) for r in self.runs]
        self.step(items)
        self.zero()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dev == "cuda" else [])
        with profile(activities=acts) as prof:
            self.step(items)
            sync()
        self.zero()
        ka = prof.key_averages()
        table = None
        for key in (("device_time_total", "cuda_time_total") if self.dev == "cuda" else ("cpu_time_total",)):
            try:
                table = ka.table(sort_by=key, row_limit=45, max_name_column_width=70)
                break
            except Exception:
                continue
        table = table or ka.table(row_limit=45)
        if OUT is not None:
            (OUT / "profile_cobatch8.txt").write_text(table)
        print(table[:6000], flush=True)


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="a toy model (CPU dry run)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16384, help="engine micro-batch cap (padded tokens)")
    ap.add_argument("--chunk-tokens", type=int, default=4096, help="vocabulary projection chunk")
    ap.add_argument("--rl-profile", default="8@4096,1@16384",
                    help="rl section: the passes profiled, RUNS@MAX_TOKENS, comma-separated")
    ap.add_argument("--sections", default="check,cobatch,ablate,full,ragged,optim,big,profile")
    ap.add_argument("--gpu-memory", type=float, default=float(os.environ.get("OPENRL_TRAINER_GPU_MEMORY") or 0) or None,
                    help="cap this process at this fraction of the GPU, as `openrl serve`'s trainer is "
                         "(default $OPENRL_TRAINER_GPU_MEMORY, else the whole GPU); the rl section then adds "
                         "the same 8-run pass without the memory budget and drops the micro-batch-cap rows")
    args = ap.parse_args()
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    t0 = time.time()
    b = Bench(args)
    for s in args.sections.split(","):
        t = time.time()
        try:
            getattr(b, f"s_{s}")()
        except Exception as e:
            log(what=f"section_{s}", error=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-1500:])
            b.zero()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        log(what="section_done", section=s, s=round(time.time() - t, 1))
    log(what="done", total_s=round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
