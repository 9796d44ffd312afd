"""PEFT adapter files: ``adapter_model.safetensors`` (keys
``base_model.model.<module path>.lora_{A,B}.weight``) + ``adapter_config.json``, the layout
``peft.PeftModel.from_pretrained(base, dir)`` and vLLM's LoRA loader read.

With ``train_unembed`` (Tinker's default) the unembedding LoRA is
``base_model.model.lm_head.lora_{A,B}.weight`` ([r, hidden], [vocab, r]) with ``"lm_head"`` in
``target_modules``: the names PEFT gives a LoRA on the ``nn.Linear`` output projection (not
``lora_embedding_{A,B}``, which PEFT uses for ``nn.Embedding``), so PEFT applies it to the
logits only, as the trainer does, also on a tied-embedding base
(tests/stack/test_weights_download.py loads a downloaded adapter with PEFT and matches the
server's logprobs)."""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor

from openrl.errors import UserError
from openrl.model.lora.model import MultiLoRAModel

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"


def save_peft_adapter(model: MultiLoRAModel, name: str, directory: Path) -> None:
    """Write adapter ``name`` of ``model`` as :data:`ADAPTER_WEIGHTS_NAME` (float32) +
    :data:`ADAPTER_CONFIG_NAME` in ``directory`` (created if needed).

    Raises:
        KeyError: unknown adapter. OSError: the directory cannot be written.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(model.peft_state_dict(name), str(directory / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG_NAME).write_text(json.dumps(model.peft_config(name), indent=2, sort_keys=True))


def read_peft_adapter(directory: Path) -> tuple[dict[str, Tensor], dict]:
    """Read ``(state_dict, adapter_config)`` from a PEFT adapter directory (tensors on CPU).

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
    """(Re)create adapter ``name`` of ``model`` from a PEFT adapter directory.

    Raises:
        UserError: unreadable files, or an adapter that does not fit the model (field
            ``checkpoint``); a previous adapter ``name`` is then untouched.
    """
    sd, cfg = read_peft_adapter(directory)
    model.load_peft_state_dict(name, sd, cfg, seed=seed)


def write_adapter_direct(params: list[tuple[str, Tensor]], path: Path, dtype=None, *, staged: bool = True) -> int:
    """Write ``params`` as a safetensors file with one device-to-host copy:
    :func:`openrl.model.lora.packed.pack_adapter` then :func:`~openrl.model.lora.packed.write_packed`
    (``staged``: through a pinned host buffer; else straight into the file's mapped pages).

    The file holds the same tensors as :func:`safetensors.torch.save_file` would write
    (metadata ``{"format": "pt"}``, the data in the given order), so PEFT, vLLM and
    :func:`read_peft_adapter` read it.

    Args:
        params: ``(key, tensor)`` pairs, one device, e.g.
            :meth:`MultiLoRAModel.named_adapter_parameters` (float32 ``[r, in]`` / ``[out, r]``).
        path: the file to create (replaced if present).
        dtype: the stored dtype (default: the first tensor's; float32 / bfloat16 / float16).

    Returns:
        The file's size in bytes.

    Raises:
        ValueError: no parameters, or a dtype safetensors has no name for here.
        OSError: the file cannot be created (e.g. the tmpfs is full: ENOSPC).
    """
    from openrl.model.lora.packed import pack_adapter, write_packed

    return write_packed(pack_adapter(params, dtype), Path(path), staged=staged)


def export_peft_direct(model: MultiLoRAModel, name: str, directory: Path, *, staged: bool = True) -> int:
    """Write adapter ``name`` of ``model`` as :func:`save_peft_adapter` does (float32
    ``adapter_model.safetensors`` + ``adapter_config.json`` in ``directory``, created if
    needed), through :func:`write_adapter_direct`: one device-to-host copy into the file.

    Returns:
        Bytes written (both files).

    Raises:
        KeyError: unknown adapter. OSError: the directory cannot be written.
    """
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    n = write_adapter_direct(model.named_adapter_parameters(name), directory / ADAPTER_WEIGHTS_NAME, torch.float32,
                             staged=staged)
    cfg = json.dumps(model.peft_config(name), indent=2, sort_keys=True)
    (directory / ADAPTER_CONFIG_NAME).write_text(cfg)
    return n + len(cfg)
