# Copied from ../shared/bench/peft_baseline_h200.py (the measurement behind
# ../shared/reference/h200-baselines.md), so that it travels to the GPU machine with the
# checkout and runs in the same job as our benchmarks. One change: NEW_TOKENS (default 128,
# as the original) sets the number of generated tokens in the HF generate measurements, so a
# short run can keep them (tokens/s is per generated token either way).
"""Anchor measurements on one H200: what plain transformers+peft gives a user today.

Qwen3-4B shapes, random bf16 weights. Prints a JSON line per measurement.
"""
import json, time, os, sys
import torch

def log(**kw):
    print(json.dumps(kw), flush=True)

dev = "cuda"
torch.backends.cuda.matmul.allow_tf32 = True

# 1. bf16 matmul peak
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): a @ b
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 20
peak = 2 * 8192**3 / dt
log(what="bf16_matmul_peak_tflops", value=peak / 1e12)
del a, b

from transformers import Qwen3Config, Qwen3ForCausalLM
from peft import LoraConfig, get_peft_model

cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1_000_000, tie_word_embeddings=True, torch_dtype="bfloat16")
cfg._attn_implementation = os.environ.get("ATTN", "sdpa")
torch.manual_seed(0)
with torch.device(dev):
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
n_params = sum(p.numel() for p in model.parameters())
n_nonembed = n_params - model.model.embed_tokens.weight.numel()
log(what="params", total=n_params, non_embedding=n_nonembed)

targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
names = [f"a{i}" for i in range(8)]
pm = get_peft_model(model, LoraConfig(r=32, lora_alpha=32, target_modules=targets), adapter_name=names[0])
for n in names[1:]:
    pm.add_adapter(n, LoraConfig(r=32, lora_alpha=32, target_modules=targets))
pm.gradient_checkpointing_enable() if os.environ.get("GC") == "1" else None

B, T = int(os.environ.get("B", 8)), int(os.environ.get("T", 1024))
ids = torch.randint(0, 151936, (B, T), device=dev)

def step(adapter):
    pm.set_adapter(adapter)
    out = pm(input_ids=ids)
    logits = out.logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss

for _ in range(2): step(names[0])
torch.cuda.synchronize()
reps = 5
t = time.perf_counter()
for _ in range(reps): step(names[0])
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / reps
tok = B * T
flops = 4 * n_nonembed * tok + 2 * 2 * cfg.hidden_size * cfg.vocab_size * tok  # fwd+input-grad for body; lm head fwd+bwd-input
log(what="peft_single_adapter_fwd_bwd", batch=B, seq=T, s_per_step=dt, tokens_per_s=tok / dt,
    mfu_vs_measured_peak=flops / dt / peak, peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9)

# 8 runs one after another (what peers do: swap adapter, run, next)
t = time.perf_counter()
for n in names: step(n)
torch.cuda.synchronize(); dt8 = time.perf_counter() - t
log(what="peft_8_adapters_sequential", total_s=dt8, aggregate_tokens_per_s=8 * tok / dt8)

# one big batch of 8x rows with a single adapter: the co-batching ceiling (base matmuls shared)
K = int(os.environ.get('K', 4))
ids_big = torch.randint(0, 151936, (K * B, T), device=dev)
def big():
    pm.set_adapter(names[0])
    out = pm(input_ids=ids_big)
    logits = out.logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids_big[:, 1:].reshape(-1))
    loss.backward()
for gc in (False, True):
    try:
        if gc: pm.gradient_checkpointing_enable(); pm.enable_input_require_grads()
        pm.zero_grad(set_to_none=True); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        big(); torch.cuda.synchronize(); t = time.perf_counter(); big(); torch.cuda.synchronize(); dtb = time.perf_counter() - t
        log(what="one_batch_4x_rows_single_adapter", grad_ckpt=gc, s=dtb, tokens_per_s=K * tok / dtb, peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9)
        break
    except torch.OutOfMemoryError as e:
        log(what="one_batch_4x_rows_single_adapter", grad_ckpt=gc, error="OOM")
pm.gradient_checkpointing_disable()
del ids_big
pm.zero_grad(set_to_none=True); torch.cuda.empty_cache()

# sampling: HF generate, batch 1/8/128, 128 new tokens, one adapter
if os.environ.get('SKIP_SAMPLE') == '1': sys.exit(0)
pm.eval()
NEW = int(os.environ.get('NEW_TOKENS', 128))
for bs in (1, 8, 128):
    prompt = torch.randint(0, 151936, (bs, 64), device=dev)
    with torch.no_grad():
        pm.generate(input_ids=prompt, max_new_tokens=8, do_sample=True, min_new_tokens=8)
        torch.cuda.synchronize(); t = time.perf_counter()
        out = pm.generate(input_ids=prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, top_p=1.0)
        torch.cuda.synchronize(); dt = time.perf_counter() - t
    log(what="hf_generate_decode", batch=bs, new_tokens=NEW, tokens_per_s=bs * NEW / dt, s=dt)
# mixed adapters in one generate batch (peft adapter_names)
bs = 128
prompt = torch.randint(0, 151936, (bs, 64), device=dev)
an = [names[i % 8] for i in range(bs)]
try:
    with torch.no_grad():
        torch.cuda.synchronize(); t = time.perf_counter()
        pm.generate(input_ids=prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, adapter_names=an)
        torch.cuda.synchronize(); dt = time.perf_counter() - t
    log(what="hf_generate_decode_8_adapters_mixed", batch=bs, new_tokens=NEW, tokens_per_s=bs * NEW / dt, s=dt)
except Exception as e:
    log(what="hf_generate_decode_8_adapters_mixed", error=repr(e)[:300])
