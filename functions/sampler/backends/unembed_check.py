"""Does a sampler backend apply an adapter's unembedding (``lm_head``) LoRA to the logits it
samples from? A check that needs nothing but the backend's own ``sample``.

The trainer trains the unembedding LoRA by default (Tinker's ``train_unembed=True``); a
backend that ignored it would sample a different policy than the one trained (issue 22: 0.56
nats mean after 5 steps at lr 1e-2). vLLM 0.24 applies it to sampled tokens
(``LogitsProcessorWithLoRA``) but not to prompt logprobs (vllm-project/vllm#51594: its LoRA
mapping for logits has one row per sequence, prompt logprobs have one per prompt token), so
the check looks at the first *sampled* token only.

The probe (:func:`write_unembed_probe`) is a copy of a real adapter (same body LoRA, same rank,
so the backend accepts it like the original) whose lm_head LoRA is replaced: row ``j`` of
``lora_A`` is a seeded random ±1/sqrt(H) vector ``a_j``, and ``lora_B`` is zero but for
``B[t_j, j] = PROBE_LOGIT / scaling``, so token ``t_j``'s logit moves by ``PROBE_LOGIT * a_j . h``
(``h`` the final normed hidden state; ``a_j . h`` is about unit-normal), every other logit by
nothing. Over :data:`N_PROMPTS` prompts and ``r`` probe tokens some move is large and positive
with overwhelming probability (all ``8 r`` below 0.17 sigma: about 0.57^(8 r)), and the greedy
first token then changes to that ``t_j`` with a logprob near 0. A backend that ignores lm_head
LoRA computes the probe exactly as the adapter: the same greedy token and logprob.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Awaitable, Callable

from functions.sampler.types import SampleResult
from openrl.contract.payloads import Sample, SamplingParams
from openrl.errors import UserError
from openrl.model.lora import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, UNEMBED_TARGET

#: nats a probe token's logit moves per unit of ``a_j . h``.
PROBE_LOGIT = 30.0
#: least change (nats) of the greedy first token's logprob, or a different token, that counts
#: as "applied".
MIN_EFFECT = 0.5
#: prompts the check samples (one greedy token each, under the adapter and under the probe).
N_PROMPTS = 8
#: ``base_model`` of the check's jobs: backends ignore it (a backend serves one base model).
PROBE_BASE_MODEL = "unembed-check"


def _lm_head_key(sd: dict, part: str) -> str | None:
    for k in sd:
        parts = k.split(".")
        if UNEMBED_TARGET in parts and part in parts:
            return k
    return None


def write_unembed_probe(src: Path, dst: Path, seed: int = 0) -> tuple[Path, list[int]]:
    """Write the probe of adapter ``src`` (see the module doc) to ``dst``.

    Returns:
        ``(dst, [t_0 .. t_{r-1}])``, the probe tokens (distinct ids below the vocabulary size
        ``lora_B`` has).

    Raises:
        UserError("model_path", ...): ``src`` unreadable or without an lm_head LoRA.
    """
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    try:
        sd = load_file(str(src / ADAPTER_WEIGHTS_NAME))
        cfg = json.loads((src / ADAPTER_CONFIG_NAME).read_text())
    except Exception as e:
        raise UserError("model_path", f"cannot read adapter in {src}: {e}") from None
    ka, kb = _lm_head_key(sd, "lora_A"), _lm_head_key(sd, "lora_B")
    if ka is None or kb is None:
        raise UserError("model_path", f"{src} has no lm_head LoRA")
    a, b = sd[ka], sd[kb]  # [r, H], [V, r]
    r, H = a.shape
    V = b.shape[0]
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha") or cfg["r"])
    scaling = alpha / rank ** 0.5 if cfg.get("use_rslora") else alpha / rank
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (r, H), generator=g).float() * 2 - 1
    tokens = random.Random(seed).sample(range(V), r)
    new_b = torch.zeros(V, r)
    for j, t in enumerate(tokens):
        new_b[t, j] = PROBE_LOGIT / scaling
    sd[ka] = (signs / H ** 0.5).to(a.dtype)
    sd[kb] = new_b.to(b.dtype)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    save_file(sd, str(dst / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    (dst / ADAPTER_CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return dst, tokens


def probe_prompts(vocab_size: int, n: int = N_PROMPTS, length: int = 6, seed: int = 0) -> list[list[int]]:
    """``n`` seeded prompts of ``length`` token ids below ``vocab_size``."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(n)]


def unembed_applied(under_adapter: list[tuple[int, float]], under_probe: list[tuple[int, float]]) -> tuple[bool, float]:
    """Given ``(greedy first token, its logprob)`` per prompt under the adapter and under its
    probe: applied when some prompt's token differs or its logprob moved by more than
    :data:`MIN_EFFECT` nats.

    Returns:
        ``(applied, largest |logprob change| in nats; inf where a token changed)``.

    Raises:
        ValueError: empty lists or lists of different lengths.
    """
    if not under_adapter or len(under_adapter) != len(under_probe):
        raise ValueError(f"need equal, non-empty lists, got {len(under_adapter)} and {len(under_probe)}")
    d = 0.0
    for (ta, la), (tp, lp) in zip(under_adapter, under_probe):
        d = max(d, float("inf") if ta != tp else abs(la - lp))
    return d > MIN_EFFECT, d


async def check_unembed(
    sample: Callable[[Sample], Awaitable[SampleResult]],
    load: Callable[[str, Path], Awaitable[None]],
    unload: Callable[[str], Awaitable[None]],
    key: str,
    directory: Path,
    workdir: Path,
    vocab_size: int,
) -> tuple[bool, str]:
    """Run the check on a backend: ``key`` is a loaded adapter with an lm_head LoRA read from
    ``directory``; the probe is written under ``workdir``, loaded as ``<key>#unembed-probe``,
    sampled, and unloaded. Requests go one at a time (the same batch shape for both).

    Returns:
        ``(applied, a one-line summary)``. Exceptions of the backend propagate.
    """
    probe_key = f"{key}#unembed-probe"
    path, tokens = write_unembed_probe(directory, Path(workdir) / "unembed-probe")
    await load(probe_key, path)
    try:
        runs: dict[str, list[tuple[int, float]]] = {key: [], probe_key: []}
        for prompt in probe_prompts(vocab_size):
            for k in (key, probe_key):
                job = Sample(prompt_tokens=prompt, base_model=PROBE_BASE_MODEL, model_path=k,
                             sampling_params=SamplingParams(max_tokens=1, temperature=0.0, stop=[]))
                s = (await sample(job)).sequences[0]
                runs[k].append((int(s.tokens[0]), float(s.logprobs[0])))
    finally:
        await unload(probe_key)
    applied, d = unembed_applied(runs[key], runs[probe_key])
    hits = sum(tp in tokens for tp, _ in runs[probe_key])
    return applied, (f"greedy first token moved by up to {d:.3g} nats; {hits}/{len(runs[key])} prompts switched "
                     f"to a probe token")
