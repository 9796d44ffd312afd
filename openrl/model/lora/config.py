"""LoRA configuration: which modules an adapter targets, its rank, alpha and seed, and the
mapping to and from PEFT's ``adapter_config.json`` (the role of PEFT's
``tuners/lora/config.py``).

Module names are matched by their last path component (``model.layers.0.self_attn.q_proj``
-> ``q_proj``); adapters target whole groups (attention, MLP, unembedding).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping

from openrl.errors import UserError

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGET = "lm_head"
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS + (UNEMBED_TARGET,)

#: alpha used when ``LoraSpec.alpha`` is None (Tinker convention: 32 for all ranks).
DEFAULT_LORA_ALPHA = 32.0

#: Prefix of every PEFT adapter tensor name: ``base_model.model.<module path>.lora_{A,B}.weight``.
PEFT_KEY_PREFIX = "base_model.model."


@dataclass
class LoraSpec:
    """LoRA configuration of one adapter (mirrors the SDK's ``tinker.types.LoraConfig``).

    Attributes:
        rank: LoRA rank r (>= 1).
        alpha: LoRA alpha; the delta is scaled by ``alpha / rank``. None means
            :data:`DEFAULT_LORA_ALPHA` (32, whatever the rank).
        seed: seed of ``A``'s initialisation. None: a random seed is drawn when the adapter
            is created and recorded (see ``MultiLoRAModel.adapter_spec``), so a saved run
            always knows its seed.
        train_attn: adapt q/k/v/o projections.
        train_mlp: adapt gate/up/down projections.
        train_unembed: adapt the unembedding (``lm_head``).
    """

    rank: int
    alpha: float | None = None
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def targets(self) -> tuple[str, ...]:
        """Module-name suffixes this spec adapts, in :data:`ALL_TARGETS` order."""
        out: tuple[str, ...] = ()
        if self.train_attn:
            out += ATTN_TARGETS
        if self.train_mlp:
            out += MLP_TARGETS
        if self.train_unembed:
            out += (UNEMBED_TARGET,)
        return out

    @property
    def resolved_alpha(self) -> float:
        """``alpha``, or :data:`DEFAULT_LORA_ALPHA` when None (a float)."""
        return float(DEFAULT_LORA_ALPHA if self.alpha is None else self.alpha)

    @property
    def scaling(self) -> float:
        """``alpha / rank``, the factor applied to ``B @ A``."""
        return self.resolved_alpha / self.rank

    def validate(self) -> None:
        """Raise :class:`UserError` (field ``lora_config.*``) if the spec is unusable."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise UserError("lora_config.rank", f"must be an integer >= 1, got {self.rank!r}")
        if self.alpha is not None and not (math.isfinite(float(self.alpha)) and float(self.alpha) > 0):
            raise UserError("lora_config.alpha", f"must be a positive finite number, got {self.alpha!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise UserError("lora_config.seed", f"must be an integer, got {self.seed!r}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise UserError(
                "lora_config", "at least one of train_attn, train_mlp, train_unembed must be true"
            )

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (``from_dict`` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "LoraSpec":
        """The spec of a :meth:`to_dict` dict (missing target flags default to True).

        Raises:
            KeyError: no ``rank``. ValueError / TypeError: a value of the wrong type.
        """
        return cls(
            rank=int(d["rank"]),
            alpha=None if d.get("alpha") is None else float(d["alpha"]),
            seed=None if d.get("seed") is None else int(d["seed"]),
            train_attn=bool(d.get("train_attn", True)),
            train_mlp=bool(d.get("train_mlp", True)),
            train_unembed=bool(d.get("train_unembed", True)),
        )

    # ------------------------------------------------------------------ PEFT

    def to_peft_config(self, target_modules: list[str], base_model_name: str | None) -> dict:
        """``adapter_config.json`` content (a ``peft.LoraConfig``) for this spec.

        Args:
            target_modules: the module-name suffixes the model actually adapts (sorted by
                the caller).
            base_model_name: ``base_model_name_or_path`` (None when unknown).
        """
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name or None,
            "r": self.rank,
            "lora_alpha": self.resolved_alpha,
            "lora_dropout": 0.0,
            "target_modules": target_modules,
            "bias": "none",
            "fan_in_fan_out": False,
            "init_lora_weights": True,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
            "inference_mode": True,
            "rank_pattern": {},
            "alpha_pattern": {},
        }

    @classmethod
    def from_peft_config(cls, config: Mapping, seed: int | None = None) -> "LoraSpec":
        """The spec of a PEFT ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``).

        Args:
            config: the parsed JSON.
            seed: recorded in the spec (the weights come from the adapter file).

        Raises:
            UserError("checkpoint", ...): unreadable values, DoRA / rsLoRA / per-module
                rank or alpha, unknown targets, or targets that are not whole groups.
        """
        try:
            rank = int(config["r"])
            alpha = float(config.get("lora_alpha", DEFAULT_LORA_ALPHA))
            targets = config.get("target_modules") or []
            if isinstance(targets, str):
                targets = [targets]
            targets = {str(t).rsplit(".", 1)[-1] for t in targets}
        except (KeyError, TypeError, ValueError) as e:
            raise UserError("checkpoint", f"bad adapter config: {e}") from None
        if config.get("use_dora") or config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
            raise UserError("checkpoint", "DoRA / rsLoRA / per-module rank or alpha are not supported")
        unknown = targets - set(ALL_TARGETS)
        if unknown:
            raise UserError("checkpoint", f"unsupported LoRA target modules {sorted(unknown)}")
        spec = cls(
            rank=rank,
            alpha=alpha,
            seed=seed,
            train_attn=bool(targets & set(ATTN_TARGETS)),
            train_mlp=bool(targets & set(MLP_TARGETS)),
            train_unembed=UNEMBED_TARGET in targets,
        )
        if set(spec.targets()) != targets:
            raise UserError(
                "checkpoint", f"target_modules {sorted(targets)} must be whole groups (attention, mlp, lm_head)"
            )
        return spec
