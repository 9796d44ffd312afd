"""Where vLLM's adapter load goes (issue 31): one trainer snapshot into vLLM's LoRA slots, split.

    PYTHONPATH=$STK:$SITE:$PWD python bench/vllm_lora_load.py --model-dir DIR [--out DIR] [--n 6]
    .venv/bin/python bench/vllm_lora_load.py --model-dir DIR --no-vllm     (the trainer-side part, CPU)

A part of the save -> sample path, not a product number: the product's number is the RL step of
``bench/stack_h200.py`` (``openrl_sampler_adapter_load_seconds`` beside it). On the H200
(2026-12-04, 9c534fa) that metric was 0.60 s per new snapshot with one run, and loads of 8 runs
queued in vLLM's engine core (2.5 s each, wall) while the others' decoding waited.

1. **The trainer's side.** The base model (``--model-dir``, bf16 on CUDA) under
   :class:`openrl.model.lora.MultiLoRAModel` with one rank-``--rank`` adapter of the trainer's
   defaults (attention, MLP and ``lm_head``), ``B`` filled with small random values. Timed:
   ``export_fp32`` (:func:`openrl.model.lora.peft_io.export_peft_direct`, what an unnamed snapshot
   costs the trainer today), ``export_bf16`` (the same tensors written as bfloat16 by
   :func:`~openrl.model.lora.peft_io.write_adapter_direct`), ``convert_bf16`` (read the float32
   file, cast, write bf16: what a sampler would pay to hand vLLM its serving dtype).
2. **vLLM's side** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process,
   so its functions can be timed; ``enforce_eager``: CUDA graphs do not matter for a load).
   ``LLMEngine.add_lora`` of a new LoRA id, synchronised, per file variant, ``--n`` times each
   (fp32, bf16, fp32 again: the second fp32 round shows a warm pinned-memory cache), the oldest
   adapter removed beyond 6 as the sampler's LRU does. Split with wrappers around vLLM's own
   functions (read-only timing, the functions are called unchanged): ``read`` (safetensors into
   CPU tensors), ``tensors`` (``LoRAModel.from_lora_tensors``: dtype cast + ``pin_memory``),
   ``merge`` (``_create_merged_loras_inplace``: packing q/k/v and gate/up, scaling into B, pin),
   ``activate`` (copies into the GPU slot), ``pin`` (every ``Tensor.pin_memory`` call, also
   counted inside the others), ``other`` (the rest: config, checks, the engine's bookkeeping).
   Then one greedy 8-token ``generate`` on the last adapter of each variant: the first request
   after a load.

Output: one JSON line per measurement on stdout and in ``OUT/lora_load.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_OUT: list[str] = []


def emit(**row) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    _OUT.append(line)


def trainer_side(model_dir: Path, work: Path, rank: int, reps: int, device: str) -> dict[str, Path]:
    """Write the fp32 and bf16 adapter files as the trainer would; returns ``{variant: dir}``."""
    import torch
    from transformers import AutoModelForCausalLM

    from openrl.model.lora import LoraSpec, MultiLoRAModel
    from openrl.model.lora.peft_io import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, export_peft_direct, \
        write_adapter_direct

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    m = MultiLoRAModel(base)
    m.add_adapter("a", LoraSpec(rank=rank, seed=0))
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for k, p in m.named_adapter_parameters("a"):
            if ".lora_B." in k:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=p.dtype) * 1e-3)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dirs = {"fp32": work / "fp32", "bf16": work / "bf16"}
    times: dict[str, list[float]] = {"export_fp32": [], "export_bf16": [], "convert_bf16": []}
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        n32 = export_peft_direct(m, "a", dirs["fp32"])
        times["export_fp32"].append(time.perf_counter() - t0)
        dirs["bf16"].mkdir(parents=True, exist_ok=True)
        sync()
        t0 = time.perf_counter()
        n16 = write_adapter_direct(m.named_adapter_parameters("a"), dirs["bf16"] / ADAPTER_WEIGHTS_NAME, torch.bfloat16)
        times["export_bf16"].append(time.perf_counter() - t0)
        (dirs["bf16"] / ADAPTER_CONFIG_NAME).write_text((dirs["fp32"] / ADAPTER_CONFIG_NAME).read_text())
        t0 = time.perf_counter()
        from safetensors.torch import load_file, save_file
        sd = load_file(str(dirs["fp32"] / ADAPTER_WEIGHTS_NAME))
        save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(work / "conv.safetensors"))
        times["convert_bf16"].append(time.perf_counter() - t0)
    emit(what="trainer_side", device=device, rank=rank, tensors=len(m.named_adapter_parameters("a")),
         bytes_fp32=n32, bytes_bf16=n16, **{k: round(statistics.median(v), 4) for k, v in times.items()})
    if device == "cuda":
        export_split(m.named_adapter_parameters("a"), work, reps)
    del m, base
    if device == "cuda":
        torch.cuda.empty_cache()
    return dirs


def export_split(params, work: Path, reps: int) -> None:
    """Where ``write_adapter_direct``'s float32 export goes (CUDA only): ``cat`` (the one
    ``torch.cat`` on the GPU), ``d2h_pageable`` (into a new, untouched CPU tensor),
    ``d2h_pinned`` (into a pinned buffer kept across saves), ``shm_fresh`` (pinned buffer ->
    a new tmpfs file through ``mmap``: the page faults + memcpy), ``shm_populate`` (the same with
    ``MAP_POPULATE``), ``direct`` (the product's path: GPU -> the new file's mapped pages),
    ``direct_registered`` (the same after ``cudaHostRegister`` of the mapping, register and
    unregister included), ``shm_write`` (pinned buffer -> a new tmpfs file with one ``write``),
    ``staged`` (the product's path since issue 31's third session: ``pack_adapter`` +
    ``write_packed``, a side-stream copy into a kept pinned buffer, then one ``write``),
    ``staged_pack`` (its part under the engine lock: the queued ``torch.cat``, not waited for),
    ``staged_spare`` (the new path over a pre-allocated file, ``OPENRL_HANDOFF_SPARES``; the
    allocation, ``spare_alloc``, is timed apart: the product makes it in the background).
    Medians over ``reps``, seconds; one JSON line."""
    import mmap

    import torch

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def cat():
        return torch.cat([t.detach().reshape(-1).float() for _, t in params])

    flat = cat().view(torch.uint8)
    n = flat.numel()
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    cudart = torch.cuda.cudart()
    from openrl.model.lora.packed import pack_adapter, write_packed

    out: dict[str, list[float]] = {k: [] for k in ("cat", "d2h_pageable", "d2h_pinned", "shm_fresh", "shm_populate",
                                                   "direct", "shm_write", "staged", "staged_pack",
                                                   "spare_alloc", "staged_spare", "direct_registered")}

    def write_from(src) -> None:
        path = work / "split-write.bin"
        path.unlink(missing_ok=True)
        with open(path, "wb") as f:
            f.write(memoryview(src.numpy()))
        path.unlink()

    def staged() -> None:
        path = work / "split-staged.bin"
        path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        packed = pack_adapter(params, torch.float32)
        out["staged_pack"].append(time.perf_counter() - t0)
        write_packed(packed, path)
        path.unlink()

    def staged_spare() -> None:
        path = work / "split-spare.bin"
        path.unlink(missing_ok=True)
        packed = pack_adapter(params, torch.float32)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, packed.nbytes)
        out["spare_alloc"].append(time.perf_counter() - t0)
        out["staged_spare"].append(timed(lambda: write_packed(packed, path)))
        path.unlink()

    def to_file(name: str, src=None, populate: bool = False, register: bool = False) -> None:
        path = work / f"split-{name}.bin"
        path.unlink(missing_ok=True)
        with open(path, "w+b") as f:
            f.truncate(n)
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            with mmap.mmap(f.fileno(), n, flags=flags) as mm:
                dst = torch.frombuffer(mm, dtype=torch.uint8, count=n)
                if register:
                    rc = cudart.cudaHostRegister(dst.data_ptr(), n, 0)
                    if int(rc) != 0:
                        raise RuntimeError(f"cudaHostRegister of the tmpfs mapping: {rc}")
                dst.copy_(flat if src is None else src)
                if register:
                    torch.cuda.synchronize()
                    cudart.cudaHostUnregister(dst.data_ptr())
                del dst
        path.unlink()

    for _ in range(reps):
        out["cat"].append(timed(cat))
        out["d2h_pageable"].append(timed(lambda: torch.empty(n, dtype=torch.uint8).copy_(flat)))
        out["d2h_pinned"].append(timed(lambda: pinned.copy_(flat)))
        out["shm_fresh"].append(timed(lambda: to_file("fresh", pinned)))
        out["shm_populate"].append(timed(lambda: to_file("populate", pinned, populate=True)))
        out["direct"].append(timed(lambda: to_file("direct")))
        out["shm_write"].append(timed(lambda: write_from(pinned)))
        out["staged"].append(timed(staged))
        staged_spare()
    try:
        for _ in range(reps):
            out["direct_registered"].append(timed(lambda: to_file("registered", register=True)))
    except RuntimeError as e:  # a tmpfs mapping CUDA will not register: say so, keep the other rows
        del out["direct_registered"]
        emit(what="export_split_error", error=str(e))
        (work / "split-registered.bin").unlink(missing_ok=True)
    emit(what="export_split", bytes=n, reps=reps, **{k: round(statistics.median(v), 4) for k, v in out.items()})


class Timers:
    """Cumulative seconds and calls of wrapped functions (wrappers call the original unchanged)."""

    def __init__(self):
        self.s: dict[str, float] = {}
        self.n: dict[str, int] = {}

    def wrap(self, owner, attr: str, name: str, kind: str = "function") -> None:
        orig = owner.__dict__.get(attr) or getattr(owner, attr)
        fn = orig.__func__ if isinstance(orig, (classmethod, staticmethod)) else orig
        timers = self

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timers.s[name] = timers.s.get(name, 0.0) + time.perf_counter() - t0
                timers.n[name] = timers.n.get(name, 0) + 1

        wrapper.__wrapped__ = fn
        setattr(owner, attr, classmethod(wrapper) if isinstance(orig, classmethod) else wrapper)

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        return dict(self.s), dict(self.n)


def vllm_side(model_dir: Path, dirs: dict[str, Path], rank: int, n: int, gpu_mem: float, mp: bool = False) -> None:
    """``mp``: the engine core in its own process, as the product runs it (vLLM's default): then
    only ``total`` is measured (the wrappers here do not see the engine core's process)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mp else "0"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora import lora_model, model_manager
    from vllm.lora.request import LoRARequest

    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), dtype="bfloat16", enable_lora=True, max_lora_rank=max(rank, 8), max_loras=8,
              max_cpu_loras=16, enforce_eager=True, gpu_memory_utilization=gpu_mem, max_model_len=2048, seed=0,
              skip_tokenizer_init=True)
    emit(what="vllm_start", s=round(time.perf_counter() - t0, 2))
    tm = Timers()
    tm.wrap(lora_model.LoRAModel, "from_local_checkpoint", "checkpoint")
    tm.wrap(lora_model.LoRAModel, "from_lora_tensors", "tensors")
    tm.wrap(model_manager.LoRAModelManager, "_create_merged_loras_inplace", "merge")
    tm.wrap(model_manager.LoRAModelManager, "activate_adapter", "activate")
    tm.wrap(torch.Tensor, "pin_memory", "pin")
    eng = llm.llm_engine
    live: list[int] = []
    next_id = 1
    for variant in ("fp32", "bf16", "fp32"):
        rows = []
        for _ in range(n):
            lid, next_id = next_id, next_id + 1
            s0, c0 = tm.snapshot()
            torch.cuda.synchronize()
            t = time.perf_counter()
            ok = eng.add_lora(LoRARequest(lora_name=f"{variant}-{lid}", lora_int_id=lid, lora_path=str(dirs[variant])))
            torch.cuda.synchronize()
            total = time.perf_counter() - t
            s1, c1 = tm.snapshot()
            d = {k: s1.get(k, 0.0) - s0.get(k, 0.0) for k in s1}
            part = {"read": d.get("checkpoint", 0) - d.get("tensors", 0), "tensors": d.get("tensors", 0),
                    "merge": d.get("merge", 0), "activate": d.get("activate", 0), "pin": d.get("pin", 0)}
            part["other"] = total - d.get("checkpoint", 0) - part["merge"] - part["activate"]
            rows.append({"total": total, **part, "pins": c1.get("pin", 0) - c0.get("pin", 0), "ok": bool(ok)})
            live.append(lid)
            while len(live) > 6:
                eng.remove_lora(live.pop(0))
        parts = ("total",) if mp else ("total", "read", "tensors", "merge", "activate", "pin", "other")
        med = {k: round(statistics.median(r[k] for r in rows), 4) for k in parts}
        emit(what="vllm_add_lora", engine_core="own process" if mp else "in process", variant=variant, n=n,
             median_s=med, first_s=round(rows[0]["total"], 4), pins_per_load=None if mp else rows[-1]["pins"],
             all=[round(r["total"], 4) for r in rows])
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        req = LoRARequest(lora_name=f"{variant}-{live[-1]}", lora_int_id=live[-1], lora_path=str(dirs[variant]))
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 164)))], sp, lora_request=req, use_tqdm=False)
        emit(what="vllm_first_generate", variant=variant, s=round(time.perf_counter() - t, 4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--n", type=int, default=6, help="loads per variant")
    ap.add_argument("--reps", type=int, default=3, help="trainer-side repeats")
    ap.add_argument("--gpu-memory", type=float, default=0.5)
    ap.add_argument("--no-vllm", action="store_true", help="only the trainer-side part (CPU dry run)")
    ap.add_argument("--multiprocessing", action="store_true",
                    help="vLLM's engine core in its own process (the product's way; only totals are split-free)")
    a = ap.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="openrl-lora-load-", dir=shm) as tmp:
        dirs = trainer_side(Path(a.model_dir), Path(tmp), a.rank, a.reps, device)
        if not a.no_vllm:
            vllm_side(Path(a.model_dir), dirs, a.rank, a.n, a.gpu_memory, a.multiprocessing)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "lora_load.jsonl").write_text("\n".join(_OUT) + "\n")


if __name__ == "__main__":
    main()
