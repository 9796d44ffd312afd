"""Sampling on one GPU through our sampler stack: decode tokens/s and save -> first sample.

    python bench/sampler_h200.py --backend hf|vllm [--model DIR] [--lora-prefix P] [--out DIR]

Drives ``functions.sampler.engine.SamplerEngine`` over a backend instance (the transformers
``HFBackend`` or ``VLLMBackend``), the path the sampler Function serves requests through.
Model: a Qwen3-4B-shaped directory with random bf16 weights and 8 PEFT adapters of rank 32
(``.vllm-h200/make_model.py`` writes ``/tmp/q4b`` and ``/tmp/lora0..7``).

Decode: for batch b in ``--batches`` and adapter mode none / one / mixed8 (row i uses adapter
i % 8), b concurrent jobs (one sequence each, 64-token random prompt, ``--new-tokens`` tokens,
``stop=[]`` so nothing stops early, temperature 1): ``e2e tokens/s = b * new / t``;
``decode tokens/s = b * (new - 1) / (t - t1)`` with t1 the time of the same jobs with
max_tokens = 1 (prefill + first token). Best of ``--reps``.

Save -> sample: a ``TrainerEngine`` on the same model directory (same process, same GPU)
takes one forward_backward + optim_step; then ``latency = export_sampler_weights`` (PEFT
files) + ``SamplerEngine.sample(..., adapter_dir=...)`` of 1 token on the new snapshot.
Also checks numerics: the logprobs the sampler reports for its sampled tokens vs the
trainer's ``target_logprobs`` of the same tokens (mean / max |diff|), with and without the
``lm_head`` LoRA (vLLM drops it by default: docs/benchmarks.md).

Output: JSON lines on stdout and in ``OUT/sampler_<backend>.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

OUT: Path | None = None
TAG = "hf"
DEVICE = "cuda"


def log(**kw) -> None:
    line = json.dumps(dict(backend=TAG, **kw), default=str)
    print(line, flush=True)
    if OUT is not None:
        with open(OUT / f"sampler_{TAG}.jsonl", "a") as f:
            f.write(line + "\n")


def make_hf(model: Path, rows: int):
    """HFBackend; on transformers < 5.24 (no ``cache=`` keyword on the decoder) the cache
    is passed as ``past_key_values`` (the backend passes ``cache=``)."""
    from functions.sampler.backends.hf import HFBackend

    cls = HFBackend
    from transformers.models.qwen3 import modeling_qwen3

    if "cache" not in inspect.signature(modeling_qwen3.Qwen3Model.forward).parameters:
        class Compat(HFBackend):
            def _forward(self, ids, mask, pos, cache):
                from transformers import DynamicCache

                if cache is None:
                    cache = DynamicCache()
                out = self.model.base.base_model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                                 position_ids=pos.to(self.device), past_key_values=cache, use_cache=True)
                return out.last_hidden_state, cache

        cls = Compat
        log(what="note", msg="transformers without Qwen3Model.forward(cache=): HFBackend._forward shimmed to past_key_values")
    dev = DEVICE
    return cls(model, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32, max_batch_rows=rows,
               max_prefill_tokens=rows * 64 + 64)


def make_vllm(model: Path, rows: int, util: float):
    from functions.sampler.backends.vllm import VLLMBackend

    caps = [c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256) if c <= rows]
    return VLLMBackend(model, device="cuda", max_batch_rows=rows, max_context=1024, max_loras=8, max_lora_rank=32,
                       gpu_memory_utilization=util,
                       engine_kwargs={"compilation_config": {"cudagraph_capture_sizes": caps}})


def sample_job(prompt, adapter=None, num_samples=1, **params):
    """A sampling job for ``SamplerEngine.sample``: the ``sample`` payload (prompt token ids,
    ``adapter`` = its ``model_path`` key or None, ``params`` = its ``sampling_params`` fields)."""
    from openrl.contract.payloads import Sample, SamplingParams

    return Sample(prompt_tokens=list(prompt), base_model="bench", model_path=adapter, num_samples=num_samples,
                  sampling_params=SamplingParams(**params))


async def run(args) -> None:
    from functions.sampler.engine import SamplerEngine

    model = Path(args.model)
    t0 = time.time()
    backend = make_hf(model, args.rows) if args.backend == "hf" else make_vllm(model, args.rows, args.gpu_util)
    eng = SamplerEngine(model, backend=backend, adapter_cache_size=32, max_num_samples=256)
    log(what="init", s=round(time.time() - t0, 1), limits=str(eng.limits))
    keys = [f"lora{i}" for i in range(8)]
    t = time.time()
    for i, k in enumerate(keys):
        await eng.ensure_adapter(k, Path(f"{args.lora_prefix}{i}"))
    log(what="load_8_adapters", s=round(time.time() - t, 2))
    rng = random.Random(1234)
    V = eng.limits.vocab_size
    lo, hi = min(1000, V // 8), V - min(1000, V // 8)  # ids away from the special tokens

    def jobs(b: int, mode: str, new: int, temperature: float = 1.0):
        out = []
        for i in range(b):
            ad = None if mode == "none" else keys[0] if mode == "one" else keys[i % 8]
            out.append(sample_job(prompt=[rng.randrange(lo, hi) for _ in range(64)], max_tokens=new,
                                 temperature=temperature, stop=[], adapter=ad))
        return out

    async def go(js):
        t = time.perf_counter()
        res = await asyncio.gather(*(eng.sample(j) for j in js))
        return time.perf_counter() - t, res

    t = time.time()
    for mode in ("none", "one", "mixed8"):
        await go(jobs(8, mode, 8))
        await go(jobs(min(args.rows, 128), mode, 4))
    log(what="warmup", s=round(time.time() - t, 1))

    # adapters change outputs (greedy, same prompt)
    p = [rng.randrange(lo, hi) for _ in range(32)]
    outs = {}
    for ad in (None, keys[0], keys[1]):
        r = await eng.sample(sample_job(prompt=p, max_tokens=8, temperature=0.0, stop=[], adapter=ad))
        outs[str(ad)] = r.sequences[0].tokens
    log(what="sanity", greedy=outs, lora_changes_output=outs["None"] != outs["lora0"] != outs["lora1"])

    for b in [int(x) for x in args.batches.split(",")]:
        for mode in args.modes.split(","):
            t1 = min([(await go(jobs(b, mode, 1)))[0] for _ in range(2)])
            best, ntok = None, 0
            for _ in range(args.reps):
                dt, res = await go(jobs(b, mode, args.new_tokens))
                ntok = sum(len(s.tokens) for r in res for s in r.sequences)
                assert ntok == b * args.new_tokens, ntok
                best = dt if best is None else min(best, dt)
            log(what="decode", batch=b, mode=mode, new_tokens=args.new_tokens, s=round(best, 3),
                prefill_1tok_s=round(t1, 4), e2e_tokens_per_s=round(ntok / best, 1),
                decode_tokens_per_s=round(b * (args.new_tokens - 1) / max(best - t1, 1e-6), 1))

    if args.skip_s2s:
        await eng.close()
        return
    # ------------------------------------------------------------ save -> first sample
    from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
    from openrl.model.lora import LoraSpec
    from openrl.model.logprobs import target_logprobs
    import numpy as np

    t = time.time()
    tr = TrainerEngine(model, device=DEVICE, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32, max_tokens=8192)
    log(what="trainer_load", s=round(time.time() - t, 1), kernels=tr.kernels)
    nrng = np.random.RandomState(0)
    root = Path(args.scratch)
    root.mkdir(parents=True, exist_ok=True)
    for unembed in (False, True):
        run = f"s2s_{int(unembed)}"
        tr.create_run(run, LoraSpec(rank=32, alpha=32, seed=7, train_unembed=unembed))
        for k in range(3):
            ids = nrng.randint(lo, hi, size=257).astype(np.int64)
            item = FwdBwdItem(run, [Datum(list(ids[:-1]), {"target_tokens": ids[1:], "weights": np.ones(256, np.float32)})],
                              "cross_entropy")
            tr.forward_backward([item])
            tr.optim_step(run, {"learning_rate": 2e-3})
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            d = root / f"{run}_{k}"
            key = f"tinker://bench/{run}/{k}"
            t0 = time.perf_counter()
            tr.export_sampler_weights(run, d)
            t1 = time.perf_counter()
            r = await eng.sample(sample_job(prompt=list(map(int, ids[:64])), max_tokens=1, stop=[], adapter=key), adapter_dir=d)
            t2 = time.perf_counter()
            await eng.sample(sample_job(prompt=list(map(int, ids[:64])), max_tokens=1, stop=[], adapter=key))
            t3 = time.perf_counter()
            log(what="save_to_first_sample", train_unembed=unembed, snapshot=k, export_s=round(t1 - t0, 3),
                load_and_first_sample_s=round(t2 - t1, 3), total_s=round(t2 - t0, 3), warm_sample_s=round(t3 - t2, 3))
        # numerics: sampler logprobs of its own tokens vs the trainer's
        r = await eng.sample(sample_job(prompt=list(map(int, ids[:64])), max_tokens=32, stop=[], temperature=1.0,
                                       num_samples=4, adapter=key))
        diffs = []
        for s in r.sequences:
            full = list(map(int, ids[:64])) + s.tokens
            inp = torch.tensor([full[:-1]])
            with torch.no_grad():
                lp = target_logprobs(tr.model, inp, torch.tensor([full[1:]]), None, [run])[0, 63:]
            diffs.append((lp.float().cpu() - torch.tensor(s.logprobs)).abs())
        dd = torch.cat(diffs)
        log(what="logprob_agreement_vs_trainer", train_unembed=unembed, tokens=int(dd.numel()),
            mean_abs_diff=round(float(dd.mean()), 4), max_abs_diff=round(float(dd.max()), 4),
            note="")
    if args.backend == "vllm" and args.try_keep_unembed:
        # last: lm_head LoRA passed through to vLLM (may be refused, or break the engine)
        try:
            backend.unembed_lora = "keep"
            key = "tinker://bench/keep-unembed"
            r = await asyncio.wait_for(eng.sample(sample_job(prompt=list(map(int, ids[:64])), max_tokens=32, stop=[],
                                                            num_samples=4, adapter=key), adapter_dir=d), 120)
            diffs = []
            for s in r.sequences:
                full = list(map(int, ids[:64])) + s.tokens
                with torch.no_grad():
                    lp = target_logprobs(tr.model, torch.tensor([full[:-1]]), torch.tensor([full[1:]]), None, [run])[0, 63:]
                diffs.append((lp.float().cpu() - torch.tensor(s.logprobs)).abs())
            dd = torch.cat(diffs)
            log(what="vllm_keep_unembed", ok=True, mean_abs_diff=round(float(dd.mean()), 4), max_abs_diff=round(float(dd.max()), 4))
        except Exception as e:
            log(what="vllm_keep_unembed", ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    await eng.close()


def main() -> None:
    global OUT, TAG, DEVICE
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["hf", "vllm"], required=True)
    ap.add_argument("--model", default="/tmp/q4b")
    ap.add_argument("--lora-prefix", default="/tmp/lora")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--scratch", default="/tmp/s2s")
    ap.add_argument("--batches", default="1,8,128")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--gpu-util", type=float, default=0.6)
    ap.add_argument("--modes", default="none,one,mixed8")
    ap.add_argument("--skip-s2s", action="store_true")
    ap.add_argument("--try-keep-unembed", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the hf path on a toy model")
    args = ap.parse_args()
    OUT, TAG, DEVICE = Path(args.out), args.backend, args.device
    if DEVICE == "cpu":
        torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        asyncio.run(run(args))
    except Exception as e:
        log(what="error", error=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-2500:])
    log(what="done", total_s=round(time.time() - t0, 1))
    os._exit(0)  # do not hang on vLLM's background processes / threads


if __name__ == "__main__":
    main()
