"""A training run's state in and out of the trainer engine: checkpoints (``save_state`` /
``load_state``, the PEFT adapter + AdamW state + ``run.json``), in-memory state dicts, and the
adapter snapshots a sampler loads (written to a directory, or packed in memory first).

:class:`RunStateIO` is a mixin of :class:`functions.trainer.engine.TrainerEngine`: it uses the
engine's ``model`` (:class:`~openrl.model.lora.MultiLoRAModel`), ``runs`` (model_id -> the run's
spec and :class:`~functions.trainer.optim.RunOptimizer`), ``base_model_dir``, ``_run(model_id)``
(raises ``NotFound``) and ``_new_optimizer(model_id)``. The file formats are PEFT's
(``adapter_model.safetensors``, ``adapter_config.json``), ``torch.save`` of the optimizer
state (``optimizer.pt``) and ``run.json`` (:data:`RUN_FORMAT`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from functions.trainer.optim import RunOptimizer
from openrl.errors import UserError
from openrl.model.lora import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    LoraSpec,
    read_peft_adapter,
    save_peft_adapter,
)

OPTIMIZER_NAME = "optimizer.pt"
RUN_NAME = "run.json"
RUN_FORMAT = "openrl.run.v1"


@dataclass
class Run:
    """One training run on the engine: its LoRA spec (alpha and seed resolved) and optimizer."""

    spec: LoraSpec
    optimizer: RunOptimizer


class RunStateIO:
    """Checkpoints, state dicts and sampler snapshots of the engine's runs (a mixin; see the
    module docstring for what it needs of the engine)."""

    def state_dict(self, model_id: str, with_optimizer: bool = True) -> dict:
        """``{"format", "spec", "peft_config", "adapter": {peft key: CPU tensor},
        "optimizer": RunOptimizer state or None}`` (torch.save-able)."""
        run = self._run(model_id)
        return {
            "format": RUN_FORMAT,
            "spec": run.spec.to_dict(),
            "peft_config": self.model.peft_config(model_id),
            "adapter": self.model.peft_state_dict(model_id),
            "optimizer": run.optimizer.state_dict() if with_optimizer else None,
        }

    def load_state_dict(self, model_id: str, state: Mapping, with_optimizer: bool) -> None:
        """Create or replace run ``model_id`` from :meth:`state_dict` output.

        The run takes the state's adapter (and spec); its gradients are cleared; its optimizer
        state is the saved one when ``with_optimizer`` else fresh. On any error the run is
        left exactly as it was.

        Raises:
            UserError("checkpoint", ...): incompatible or incomplete state (e.g. no optimizer
                state while ``with_optimizer``).
        """
        spec = LoraSpec.from_dict(state["spec"]) if state.get("spec") else None
        self._install(model_id, state["adapter"], state["peft_config"], spec, state.get("optimizer"), with_optimizer)

    def _install(
        self,
        model_id: str,
        adapter: Mapping[str, torch.Tensor],
        peft_config: Mapping,
        spec: LoraSpec | None,
        opt_state: Mapping | None,
        with_optimizer: bool,
    ) -> None:
        if with_optimizer and opt_state is None:
            raise UserError("checkpoint", "has no optimizer state (saved without optimizer)")
        tmp = f"{model_id}\x00staging"
        self.model.remove_adapter(tmp)
        try:
            self.model.load_peft_state_dict(tmp, adapter, peft_config, seed=None if spec is None else spec.seed)
            opt = self._new_optimizer(tmp)
            if with_optimizer:
                opt.load_state_dict(opt_state)
        except BaseException:
            self.model.remove_adapter(tmp)
            raise
        self.model.remove_adapter(model_id)
        self.model.rename_adapter(tmp, model_id)
        self.runs[model_id] = Run(self.model.adapter_spec(model_id), opt)

    def save_state(self, model_id: str, directory: Path, with_optimizer: bool = True) -> None:
        """Write the run to ``directory``: ``adapter_model.safetensors`` + ``adapter_config.json``
        (PEFT), ``optimizer.pt`` (if ``with_optimizer``), ``run.json`` (spec, step count)."""
        run = self._run(model_id)
        directory = Path(directory)
        save_peft_adapter(self.model, model_id, directory)
        if with_optimizer:
            torch.save(run.optimizer.state_dict(), directory / OPTIMIZER_NAME)
        meta = {
            "format": RUN_FORMAT,
            "spec": run.spec.to_dict(),
            "base_model_dir": str(self.base_model_dir),
            "optimizer_steps": run.optimizer.steps,
            "has_optimizer": bool(with_optimizer),
        }
        (directory / RUN_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True))

    def load_state(
        self, model_id: str, directory: Path, with_optimizer: bool, spec: LoraSpec | None = None
    ) -> None:
        """Create or replace run ``model_id`` from a :meth:`save_state` directory (or a bare
        PEFT adapter directory when ``with_optimizer`` is False).

        Args:
            spec: the spec the caller expects (e.g. the run's create_model LoRA config); if
                given, the checkpoint's rank, alpha and targets must match it.

        Raises:
            UserError("checkpoint", ...): missing files, incompatible adapter, spec mismatch,
                or no optimizer state while ``with_optimizer``.
        """
        directory = Path(directory)
        adapter, peft_config = read_peft_adapter(directory)
        saved_spec = None
        if (directory / RUN_NAME).is_file():
            try:
                saved_spec = LoraSpec.from_dict(json.loads((directory / RUN_NAME).read_text())["spec"])
            except Exception as e:
                raise UserError("checkpoint", f"unreadable {RUN_NAME}: {e}") from None
        opt_state = None
        if with_optimizer:
            path = directory / OPTIMIZER_NAME
            if not path.is_file():
                raise UserError("checkpoint", "has no optimizer state (saved without optimizer)")
            try:
                opt_state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:
                raise UserError("checkpoint", f"unreadable {OPTIMIZER_NAME}: {e}") from None
        if spec is not None:
            ck_rank = int(peft_config.get("r", -1))
            ck_alpha = float(peft_config.get("lora_alpha", -1))
            targets = {str(t).rsplit(".", 1)[-1] for t in (peft_config.get("target_modules") or [])}
            if ck_rank != spec.rank or ck_alpha != spec.resolved_alpha or targets != set(spec.targets()):
                raise UserError(
                    "checkpoint",
                    f"LoRA config (rank {ck_rank}, alpha {ck_alpha}, targets {sorted(targets)}) does not match "
                    f"the run's (rank {spec.rank}, alpha {spec.resolved_alpha}, targets {sorted(spec.targets())})",
                )
        seed_spec = saved_spec or spec
        self._install(model_id, adapter, peft_config, seed_spec, opt_state, with_optimizer)

    def export_sampler_weights(self, model_id: str, directory: Path) -> None:
        """Write only the PEFT adapter (``adapter_model.safetensors`` + ``adapter_config.json``)."""
        self._run(model_id)
        save_peft_adapter(self.model, model_id, Path(directory))

    def pack_sampler_snapshot(self, model_id: str):
        """The run's adapter packed for a sampler snapshot: ``(PackedAdapter, adapter_config)``,
        float32 in one private device buffer (:func:`openrl.model.lora.packed.pack_adapter`);
        the caller holds the engine lock, and writes it after releasing it with
        :meth:`write_packed_snapshot`.

        Raises:
            NotFound: unknown run.
        """
        from openrl.model.lora.packed import pack_adapter

        self._run(model_id)
        return pack_adapter(self.model.named_adapter_parameters(model_id), torch.float32), \
            self.model.peft_config(model_id)

    @staticmethod
    def write_packed_snapshot(snapshot, directory: Path, *, staged: bool = True) -> int:
        """Write a :meth:`pack_sampler_snapshot` into ``directory`` as ``adapter_model.safetensors``
        + ``adapter_config.json`` (:func:`openrl.model.lora.packed.write_packed`; no lock needed).
        Returns the bytes written.

        Raises:
            OSError: the directory cannot be written.
        """
        from openrl.model.lora.packed import write_packed

        packed, config = snapshot
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        n = write_packed(packed, directory / ADAPTER_WEIGHTS_NAME, staged=staged)
        cfg = json.dumps(config, indent=2, sort_keys=True)
        (directory / ADAPTER_CONFIG_NAME).write_text(cfg)
        return n + len(cfg)

    def adapter_nbytes(self, model_id: str) -> int:
        """Bytes of the run's adapter as float32 (what a sampler snapshot's weights file holds).

        Raises:
            NotFound: unknown run.
        """
        self._run(model_id)
        return sum(p.numel() * 4 for _, p in self.model.named_adapter_parameters(model_id))

    def sampler_snapshot(self, model_id: str) -> tuple[dict[str, torch.Tensor], dict]:
        """The run's adapter as PEFT tensors (float32 CPU copies) and its ``adapter_config.json``
        content: what :meth:`export_sampler_weights` writes, taken in one device-to-host copy so
        the caller can write it while the engine goes on training.

        Raises:
            NotFound: unknown run.
        """
        self._run(model_id)
        return self.model.peft_state_dict(model_id), self.model.peft_config(model_id)

    @staticmethod
    def write_sampler_snapshot(snapshot: tuple[dict[str, torch.Tensor], dict], directory: Path) -> None:
        """Write a :meth:`sampler_snapshot` as ``adapter_model.safetensors`` + ``adapter_config.json``."""
        from safetensors.torch import save_file

        tensors, config = snapshot
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        (directory / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))


__all__ = ["OPTIMIZER_NAME", "RUN_FORMAT", "RUN_NAME", "Run", "RunStateIO"]
