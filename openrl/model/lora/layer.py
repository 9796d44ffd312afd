"""The LoRA layer: an ``nn.Linear`` plus named adapters, applied per batch row (the role of
vLLM's ``lora/layers/base_linear.py``): base matmul, then one routing call."""

from __future__ import annotations

from torch import Tensor, nn

from openrl.model.lora.routing import Router


class MultiLoRALinear(nn.Module):
    """An ``nn.Linear`` plus any number of named LoRA adapters, applied per batch row.

    Input ``x``: [B, ..., in_features] with the batch as dim 0 (rows as routed by
    ``MultiLoRAModel.use_adapters``). Output: ``base(x)`` plus each routed adapter's
    delta ``((x @ A^T) * alpha/r) @ B^T`` on its rows; same shape/dtype as ``base(x)``.

    Adapters are kept in plain dicts (not registered submodules), so the base model's
    ``state_dict``/``parameters`` are unchanged; use ``MultiLoRAModel.adapter_parameters``.

    Attributes:
        base_layer: the frozen ``nn.Linear``.
        lora_A: adapter name -> float32 parameter [r, in_features].
        lora_B: adapter name -> float32 parameter [out_features, r].
        scaling: adapter name -> ``alpha / r``.
    """

    def __init__(self, base_layer: nn.Linear, router: Router):
        super().__init__()
        self.base_layer = base_layer
        self._router = router
        self.lora_A: dict[str, nn.Parameter] = {}
        self.lora_B: dict[str, nn.Parameter] = {}
        self.scaling: dict[str, float] = {}

    @property
    def in_features(self) -> int:
        """Input width of the base layer."""
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        """Output width of the base layer."""
        return self.base_layer.out_features

    @property
    def weight(self) -> Tensor:
        """The base layer's weight [out, in] (some HF code reads ``.weight`` of ``lm_head``,
        e.g. tying checks)."""
        return self.base_layer.weight

    def forward(self, x: Tensor) -> Tensor:
        """``base_layer(x)`` plus the routed adapters' deltas (see the class docstring).

        Raises:
            RuntimeError: x's batch size differs from the current routing's.
        """
        out = self.base_layer(x)
        routing = self._router.current
        if routing is None or not self.lora_A:
            return out
        return routing.add_lora(out, x, self.lora_A, self.lora_B, self.scaling)

    def extra_repr(self) -> str:
        """The adapter names, for ``repr``."""
        return f"adapters={sorted(self.lora_A)}"
