"""Check a PEFT LoRA adapter trained elsewhere against a registered base model, before it is
imported (``external_weights_upload_finish``, ``openrl adapters import``).

An adapter is importable when it is what the trainer and the sampler load
(:mod:`openrl.model.lora.peft_io`): ``adapter_config.json`` a plain LoRA (``peft_type`` LORA, no
DoRA / rsLoRA / per-module rank or alpha, ``bias: none``, no ``modules_to_save``) on whole
target groups (attention q/k/v/o, MLP gate/up/down, ``lm_head``), and ``adapter_model.safetensors``
holding exactly one ``lora_A`` [r, in] and one ``lora_B`` [out, r] floating-point, finite tensor
for every such module of the base model (PEFT's ``.default.`` key style is accepted) and nothing
else: a full weight next to them (``lm_head.base_layer.weight``, which PEFT's ``save_pretrained``
adds for a LoRA on a tied ``lm_head`` unless ``save_embedding_layers=False``) is refused rather
than dropped, since it may differ from the base model's. The module
shapes come from the base model's own ``config.json``: the model is instantiated on PyTorch's
``meta`` device (no weights read, no memory), so any Hugging Face causal-LM architecture works.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from openrl.errors import UserError

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
#: the LoRA ranks a training run may have (as ``create_model``)
MAX_RANK = 512


def _expected_shapes(model_dir: Path, targets: tuple[str, ...], rank: int) -> dict[str, tuple[int, ...]]:
    """``{peft key: shape}`` of every LoRA tensor an adapter of ``rank`` on ``targets`` needs on the
    base model in ``model_dir`` (built on the meta device)."""
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    from openrl.model.lora.config import PEFT_KEY_PREFIX

    cfg = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            out[f"{PEFT_KEY_PREFIX}{name}.lora_A.weight"] = (rank, mod.in_features)
            out[f"{PEFT_KEY_PREFIX}{name}.lora_B.weight"] = (mod.out_features, rank)
    return out


def check_peft_adapter(model_dir: Path, adapter_dir: Path, lora: dict | None = None) -> dict:
    """Validate the PEFT adapter in ``adapter_dir`` for the base model in ``model_dir``.

    Args:
        model_dir: the registered base model's Hugging Face directory (its ``config.json``).
        adapter_dir: holds :data:`ADAPTER_CONFIG_NAME` and :data:`ADAPTER_WEIGHTS_NAME`.
        lora: the LoRA shape the uploader declared (``rank``, ``train_attn``, ``train_mlp``,
            ``train_unembed``); the adapter must match it. None: take the adapter's own.

    Returns:
        The run ``lora_config`` of the adapter: ``{rank, alpha, train_attn, train_mlp,
        train_unembed}`` (``alpha`` is ``lora_alpha`` from the config: a run continued from the
        adapter keeps its scaling ``alpha / rank``).

    Raises:
        UserError: naming ``adapter_config.json``, ``adapter_model.safetensors`` (with the tensor)
            or ``lora_config.<key>``: a missing or unreadable file, an unsupported LoRA variant,
            a rank outside 1-512, targets that are not whole groups, a shape that does not fit the
            base model, a missing / extra / non-float / non-finite tensor, or a mismatch with
            ``lora``.
    """
    from openrl.model.lora.config import LoraSpec

    adapter_dir = Path(adapter_dir)
    cpath, wpath = adapter_dir / ADAPTER_CONFIG_NAME, adapter_dir / ADAPTER_WEIGHTS_NAME
    if not cpath.is_file():
        raise UserError(ADAPTER_CONFIG_NAME, "missing: a PEFT adapter directory holds adapter_config.json")
    if not wpath.is_file():
        raise UserError(ADAPTER_WEIGHTS_NAME, "missing: a PEFT adapter directory holds adapter_model.safetensors "
                                              "(convert an adapter_model.bin with PEFT first)")
    try:
        cfg = json.loads(cpath.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(ADAPTER_CONFIG_NAME, f"not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise UserError(ADAPTER_CONFIG_NAME, "must be a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise UserError(ADAPTER_CONFIG_NAME, f"peft_type {cfg.get('peft_type')!r}: only LORA adapters are imported")
    if cfg.get("bias", "none") not in (None, "none"):
        raise UserError(ADAPTER_CONFIG_NAME, f"bias {cfg.get('bias')!r}: only bias 'none' is supported")
    if cfg.get("modules_to_save"):
        raise UserError(ADAPTER_CONFIG_NAME, f"modules_to_save {cfg['modules_to_save']!r}: fully trained modules "
                                             "are not supported (LoRA tensors only)")
    try:
        spec = LoraSpec.from_peft_config(cfg)
    except UserError as exc:
        raise UserError(ADAPTER_CONFIG_NAME, exc.message.removeprefix("checkpoint: ")) from None
    if not 1 <= spec.rank <= MAX_RANK:
        raise UserError(ADAPTER_CONFIG_NAME, f"r {spec.rank}: the rank must be between 1 and {MAX_RANK}")
    if not (math.isfinite(spec.resolved_alpha) and spec.resolved_alpha > 0):
        raise UserError(ADAPTER_CONFIG_NAME, f"lora_alpha {spec.alpha!r} must be a positive number")
    if not spec.targets():
        raise UserError(ADAPTER_CONFIG_NAME, "target_modules is empty")
    out = {"rank": spec.rank, "alpha": spec.resolved_alpha, "train_attn": spec.train_attn,
           "train_mlp": spec.train_mlp, "train_unembed": spec.train_unembed}
    if lora is not None:
        for key in ("rank", "train_attn", "train_mlp", "train_unembed"):
            if key in lora and lora[key] is not None and lora[key] != out[key]:
                raise UserError(f"lora_config.{key}", f"{lora[key]!r} was declared, but adapter_config.json "
                                                      f"gives {out[key]!r}")

    from safetensors import SafetensorError
    from safetensors.torch import load_file
    import torch

    try:
        tensors = load_file(str(wpath))
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(ADAPTER_WEIGHTS_NAME, f"not a readable safetensors file: {exc}") from None
    got = {k.replace(".lora_A.default.weight", ".lora_A.weight").replace(".lora_B.default.weight", ".lora_B.weight"): v
           for k, v in tensors.items()}
    want = _expected_shapes(Path(model_dir), spec.targets(), spec.rank)
    missing = sorted(set(want) - set(got))
    if missing:
        raise UserError(ADAPTER_WEIGHTS_NAME, f"{len(missing)} LoRA tensors of the base model are missing, "
                                              f"e.g. {missing[0]}")
    extra = sorted(set(got) - set(want))
    full = [k for k in extra if ".lora_" not in k]
    if full:
        raise UserError(ADAPTER_WEIGHTS_NAME, f"tensor {full[0]} is a full weight, not a LoRA tensor (PEFT saves the "
                                              "lm_head / embedding weights next to a LoRA on a tied layer); only LoRA "
                                              "tensors are imported: save the adapter with "
                                              "save_pretrained(dir, save_embedding_layers=False)")
    if extra:
        raise UserError(ADAPTER_WEIGHTS_NAME, f"tensor {extra[0]} is not a LoRA tensor of this base model's "
                                              f"{', '.join(spec.targets())} modules ({len(extra)} such)")
    for key, shape in want.items():
        t = got[key]
        if tuple(t.shape) != shape:
            raise UserError(ADAPTER_WEIGHTS_NAME, f"{key}: shape {list(t.shape)} does not fit the base model "
                                                  f"(expected {list(shape)})")
        if not t.is_floating_point():
            raise UserError(ADAPTER_WEIGHTS_NAME, f"{key}: dtype {t.dtype} (expected a floating-point tensor)")
        if not bool(torch.isfinite(t).all()):
            raise UserError(ADAPTER_WEIGHTS_NAME, f"{key}: holds NaN or inf")
    return out
