"""The trainer's run table: which training runs this trainer holds, and on what.

One :class:`RunTable` per :class:`~functions.trainer.function.TrainerFunction`, given
explicitly to the code that needs it: the scheduler groups runs by :meth:`RunTable.group_of`
(only runs of one base model share a pass), :class:`~functions.trainer.durable.RunDurability`
flushes and restores the runs listed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class RunInfo:
    """One held training run.

    Attributes:
        base_key: the base-model directory (the key of its ``TrainerEngine``).
        base_model: the Tinker base-model name it was created on.
        lora_config: the create_model ``lora_config`` dict (rank, seed, targets).
        optimizer_config: the create_model ``optimizer_config`` (or None).
    """

    base_key: str
    base_model: str | None = None
    lora_config: dict | None = None
    optimizer_config: Any = None

    def meta(self) -> dict:
        """``{"base_model", "lora_config", "optimizer_config"}``: what checkpoints and run-state
        snapshots record about the run."""
        return {"base_model": self.base_model, "lora_config": self.lora_config,
                "optimizer_config": self.optimizer_config}


@dataclass
class RunTable:
    """model_id -> :class:`RunInfo` of the runs held here, and model_id -> owner id.

    Owners (the gateway's id of the API key that created the run, from the events' ``owner``
    extension) are kept apart: they are known from any event of a run, also before the run
    is held (usage metrics).
    """

    runs: dict[str, RunInfo] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)

    def __contains__(self, model_id: str) -> bool:
        return model_id in self.runs

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.runs))

    def __len__(self) -> int:
        return len(self.runs)

    def get(self, model_id: str) -> RunInfo | None:
        """The run's info, or None when it is not held."""
        return self.runs.get(model_id)

    def add(self, model_id: str, base_key: str, meta: dict | None = None) -> RunInfo:
        """Hold run ``model_id`` on base model ``base_key``; ``meta`` as :meth:`RunInfo.meta`."""
        meta = meta or {}
        info = RunInfo(base_key, meta.get("base_model"), meta.get("lora_config"), meta.get("optimizer_config"))
        self.runs[model_id] = info
        return info

    def remove(self, model_id: str) -> RunInfo | None:
        """Stop holding the run; returns what it was (None when it was not held)."""
        return self.runs.pop(model_id, None)

    def base_key(self, model_id: str) -> str | None:
        """The run's base-model key, None when not held."""
        info = self.runs.get(model_id)
        return info.base_key if info is not None else None

    def group_of(self, model_id: str) -> str:
        """The scheduler's packing group of a run: its base-model key, ``""`` when not held."""
        return self.base_key(model_id) or ""

    def meta(self, model_id: str) -> dict:
        """:meth:`RunInfo.meta` of the run, ``{}`` when not held."""
        info = self.runs.get(model_id)
        return info.meta() if info is not None else {}

    def set_owner(self, model_id: str, owner: str) -> None:
        """Record the owner id of a run (from an event's ``owner`` extension)."""
        self.owners[model_id] = owner

    def owner(self, model_id: str) -> str | None:
        """The owner id of a run, None when no event named one."""
        return self.owners.get(model_id)
