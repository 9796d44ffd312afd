"""Save → first sample: how long from ``save_weights_for_sampler`` to the first token sampled
on the new weights, and where the time goes.

    python bench/save_to_sample.py [--storage file,gs] [--ranks 8,32] [--repeats 5] [--big] [--json OUT]

Three parts:

1. **Sizes.** LoRA adapter bytes (float32 A and B of every adapted linear) by formula for
   Qwen3-4B shapes (36 layers, hidden 2560, intermediate 9728, 32 q / 8 kv heads x
   head_dim 128, vocab 151936; all 7 projections, with and without ``lm_head``) and for the
   built offline model, checked against the ``adapter_model.safetensors`` the stack writes.
2. **End to end through the embedded stack** (the real SDK, gateway, JetStream, trainer,
   sampler) per storage backend (``file://``; ``gs://`` on the fake-gcs-server emulator):
   ``save`` = ``save_weights_for_sampler(name).result()`` (trainer export + manifest +
   upload), ``first`` = the first ``sample(max_tokens=1)`` on that path (sampler: manifest
   read, download + sha256 verify, adapter load, one decode step), ``warm`` = a second sample
   on the same path (adapter cached): ``first - warm`` is the cold-adapter cost.
3. **Breakdown, measured on the storage calls directly** with the same code the functions
   run: ``export`` (``save_peft_adapter``), ``manifest`` (sha256 of the files), ``upload``
   (``Storage.put_dir``), ``download`` (``Storage.get_dir`` on an empty cache, including the
   sha256 verify; ``file://`` reads in place), ``load`` (``load_peft_adapter`` into the
   sampler's :class:`~openrl.model.lora.MultiLoRAModel`). With ``--big``, upload/download/sha256
   also run on synthetic files of the Qwen3-4B adapter sizes (no 4B model is loaded).

Medians over ``--repeats``; torch uses one thread in this process. The stack's workers use
``OPENRL_TORCH_THREADS`` (default: half the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # gcs_emulator
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BASE_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
F32 = 4

QWEN3_4B = {"layers": 36, "hidden": 2560, "intermediate": 9728, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
            "vocab": 151936}


def lora_params(shape: dict, rank: int, lm_head: bool) -> int:
    """LoRA parameters (A: r x in, B: out x r per adapted linear) on q/k/v/o/gate/up/down of every
    layer, plus ``lm_head`` when asked."""
    h, i = shape["hidden"], shape["intermediate"]
    q, kv = shape["q_heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)  # q, k, v, o, gate, up, down
    n = rank * per_layer * shape["layers"]
    if lm_head:
        n += rank * (h + shape["vocab"])
    return n


def tiny_shape(model_dir: Path) -> dict:
    c = json.loads((model_dir / "config.json").read_text())
    return {"layers": c["num_hidden_layers"], "hidden": c["hidden_size"], "intermediate": c["intermediate_size"],
            "q_heads": c["num_attention_heads"], "kv_heads": c["num_key_value_heads"], "head_dim": c["head_dim"],
            "vocab": c["vocab_size"]}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------- e2e

def e2e(storage: str, models: Path, ranks: list[int], repeats: int, emulator: str | None, work: Path) -> dict:
    import tinker
    from tinker import types

    from openrl.transport.embedded import Stack
    from openrl.storage import TinkerPath, open_storage

    state = work / f"state-{storage}"
    state.mkdir(parents=True)
    (state / "models").symlink_to(models, target_is_directory=True)
    kw: dict = {"extra_env": {"OPENRL_FLUSH_INTERVAL_S": "0"}}
    if storage == "gs":
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage as gcs

        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        os.environ["STORAGE_EMULATOR_HOST"] = emulator
        gcs.Client(project="openrl-test", credentials=AnonymousCredentials()).create_bucket(bucket)
        kw = {"storage": f"gs://{bucket}/ckpt",
              "extra_env": {"STORAGE_EMULATOR_HOST": emulator, "OPENRL_FLUSH_INTERVAL_S": "0"}}
    stack = Stack(state_dir=state, port=0, **kw)  # any free port
    t0 = time.perf_counter()
    stack.start()
    out: dict = {"stack_start_s": time.perf_counter() - t0, "ranks": {}}
    try:
        svc = tinker.ServiceClient(base_url=stack.base_url, api_key=(state / "api_key").read_text().strip())
        toks = list(range(1000, 1033))
        datum = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                            loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)})
        params = types.SamplingParams(max_tokens=1, temperature=0.0)
        prompt = types.ModelInput.from_ints(toks[:8])
        for rank in ranks:
            tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=rank, seed=0).result()
            save, first, warm, paths = [], [], [], []
            for k in range(repeats + 1):  # the first round warms up the sampler's base model
                tc.forward_backward([datum], "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
                t = time.perf_counter()
                path = tc.save_weights_for_sampler(f"r{rank}-{k}").result().path
                t_save = time.perf_counter() - t
                sc = svc.create_sampling_client(model_path=path)
                t = time.perf_counter()
                sc.sample(prompt, num_samples=1, sampling_params=params).result()
                t_first = time.perf_counter() - t
                t = time.perf_counter()
                sc.sample(prompt, num_samples=1, sampling_params=params).result()
                t_warm = time.perf_counter() - t
                if k:
                    save.append(t_save)
                    first.append(t_first)
                    warm.append(t_warm)
                paths.append(path)
            store = open_storage(stack.storage, cache_dir=work / f"cache-{storage}-{rank}")
            m = store.manifest(TinkerPath.parse(paths[-1]))
            out["ranks"][rank] = {
                "save_s": med(save), "first_sample_s": med(first), "warm_sample_s": med(warm),
                "save_to_first_token_s": med([a + b for a, b in zip(save, first)]),
                "adapter_bytes": m["files"]["adapter_model.safetensors"]["size"], "files": m["files"],
                "formula_bytes": lora_params(tiny_shape(models / "tiny-qwen3"), rank, True) * F32,
                "last_path": paths[-1], "storage_url": stack.storage,
            }
    finally:
        stack.stop()
    return out


# ---------------------------------------------------------------------------------- breakdown

def breakdown(storage_url: str, src_path: str, models: Path, repeats: int, work: Path, tag: str) -> dict:
    """Time export / manifest / upload / download / load for the checkpoint at ``src_path``."""
    import torch
    from transformers import AutoModelForCausalLM

    from openrl.model.lora import MultiLoRAModel, load_peft_adapter, save_peft_adapter
    from openrl.storage import TinkerPath, build_manifest, open_storage

    torch.set_num_threads(1)
    src_store = open_storage(storage_url, cache_dir=work / f"bd-src-{tag}")
    src = src_store.get_dir(TinkerPath.parse(src_path))
    base = AutoModelForCausalLM.from_pretrained(str(models / "tiny-qwen3"), dtype=torch.float32).eval()
    sampler_model = MultiLoRAModel(base)
    load_peft_adapter(sampler_model, "trained", src)  # the trained adapter, re-exported below
    res: dict[str, list[float]] = {k: [] for k in ("export", "manifest", "upload", "download", "load")}
    for k in range(repeats):
        tmp = Path(tempfile.mkdtemp(dir=work))
        t = time.perf_counter()
        save_peft_adapter(sampler_model, "trained", tmp)
        res["export"].append(time.perf_counter() - t)
        path = TinkerPath.parse(f"tinker://bench-{tag}/sampler_weights/bd-{k}-{uuid.uuid4().hex[:6]}")
        t = time.perf_counter()
        manifest = build_manifest(tmp, path, owner="bench", ttl_seconds=None, extra={})
        res["manifest"].append(time.perf_counter() - t)
        t = time.perf_counter()
        src_store.put_dir(path, tmp, manifest)
        res["upload"].append(time.perf_counter() - t)
        reader = open_storage(storage_url, cache_dir=work / f"bd-cold-{tag}-{k}")  # empty cache: a cold sampler
        t = time.perf_counter()
        local = reader.get_dir(path)
        res["download"].append(time.perf_counter() - t)
        t = time.perf_counter()
        load_peft_adapter(sampler_model, f"a{k}", local)
        res["load"].append(time.perf_counter() - t)
        sampler_model.remove_adapter(f"a{k}")
        shutil.rmtree(tmp, ignore_errors=True)
    return {k: med(v) for k, v in res.items()}


def big_files(storage_url: str, sizes: dict[str, int], work: Path, tag: str) -> dict:
    """Upload / cold download (with sha256) of synthetic adapter files of the given sizes."""
    from openrl.storage import TinkerPath, build_manifest, open_storage

    store = open_storage(storage_url, cache_dir=work / f"big-w-{tag}")
    out = {}
    for label, size in sizes.items():
        d = work / f"big-{tag}-{label}"
        d.mkdir()
        with open(d / "adapter_model.safetensors", "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(size >> 20):
                f.write(block)
            f.write(os.urandom(size & ((1 << 20) - 1)))
        (d / "adapter_config.json").write_text("{}")
        path = TinkerPath.parse(f"tinker://bench-big-{tag}/sampler_weights/{label}")
        t = time.perf_counter()
        manifest = build_manifest(d, path, owner="bench", ttl_seconds=None, extra={})
        t_sha = time.perf_counter() - t
        t = time.perf_counter()
        store.put_dir(path, d, manifest)
        t_up = time.perf_counter() - t
        reader = open_storage(storage_url, cache_dir=work / f"big-r-{tag}-{label}")
        t = time.perf_counter()
        reader.get_dir(path)
        t_down = time.perf_counter() - t
        out[label] = {"bytes": size, "sha256_s": t_sha, "upload_s": t_up, "download_verify_s": t_down}
        shutil.rmtree(d)
        store.delete(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--storage", default="file,gs")
    ap.add_argument("--ranks", default="8,32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--big", action="store_true", help="also time synthetic Qwen3-4B-sized adapter files")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    backends = [b for b in args.storage.split(",") if b]

    from openrl.model.registry import ModelRegistry, ensure_built

    models = Path(os.environ.get("OPENRL_TEST_MODELS") or Path(tempfile.gettempdir()) / "openrl-bench-models")
    ensure_built(ModelRegistry.load(None, models_dir=models))
    tiny = tiny_shape(models / "tiny-qwen3")
    results: dict = {"machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
                     "date": time.strftime("%Y-%m-%d"), "sizes": {}, "e2e": {}, "breakdown": {}, "big": {}}
    for name, shape in (("qwen3-4b", QWEN3_4B), ("tiny-qwen3", tiny)):
        for rank in sorted(set(ranks + [8, 32])):
            for head in (False, True):
                n = lora_params(shape, rank, head)
                results["sizes"][f"{name} r{rank}{' +lm_head' if head else ''}"] = {"params": n, "bytes": n * F32}

    work = Path(tempfile.mkdtemp(prefix="openrl-bench-s2s-"))
    with ExitStack() as es:
        emulator = None
        if "gs" in backends:
            from gcs_emulator import gcs_emulator

            emulator = es.enter_context(gcs_emulator())
            os.environ["STORAGE_EMULATOR_HOST"] = emulator
        for b in backends:
            r = e2e(b, models, ranks, args.repeats, emulator, work)
            results["e2e"][b] = r
            for rank, rr in r["ranks"].items():
                results["breakdown"][f"{b} r{rank}"] = breakdown(rr["storage_url"], rr["last_path"], models,
                                                                 args.repeats, work, f"{b}{rank}")
            if args.big:
                sizes = {f"4b-r{r}+lm_head": lora_params(QWEN3_4B, r, True) * F32 for r in (8, 32)}
                results["big"][b] = big_files(r["ranks"][ranks[0]]["storage_url"], sizes, work, b)
    shutil.rmtree(work, ignore_errors=True)

    print(json.dumps(results, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    # a compact table
    print("\nsizes (float32):")
    for k, v in results["sizes"].items():
        print(f"  {k:28s} {v['params']:>12,d} params  {v['bytes'] / 2**20:9.2f} MiB")
    for b, r in results["e2e"].items():
        print(f"\n{b}: stack start {r['stack_start_s']:.1f}s")
        for rank, rr in r["ranks"].items():
            bd = results["breakdown"][f"{b} r{rank}"]
            print(f"  r{rank}: adapter {rr['adapter_bytes'] / 2**20:.2f} MiB (formula "
                  f"{rr['formula_bytes'] / 2**20:.2f} MiB + safetensors header) | save {rr['save_s'] * 1e3:.0f} ms, "
                  f"first sample {rr['first_sample_s'] * 1e3:.0f} ms, warm {rr['warm_sample_s'] * 1e3:.0f} ms, "
                  f"save->first token {rr['save_to_first_token_s'] * 1e3:.0f} ms | "
                  + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in bd.items()))
    for b, r in results["big"].items():
        for label, v in r.items():
            print(f"  {b} {label}: {v['bytes'] / 2**20:.0f} MiB sha256 {v['sha256_s']:.2f}s, "
                  f"upload {v['upload_s']:.2f}s, download+verify {v['download_verify_s']:.2f}s")


if __name__ == "__main__":
    main()
