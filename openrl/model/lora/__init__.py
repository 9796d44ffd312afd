"""Multi-LoRA: many runs' LoRA adapters on one frozen base model, chosen per batch row.

Several training runs (and sampling sessions) on the same base model share one
forward/backward pass: the base matmuls run once over the whole batch, and every
wrapped ``nn.Linear`` adds, for each adapter present in the batch, the low-rank delta
of the rows that use it::

    y[R_a] = x[R_a] @ W^T + (x[R_a] @ A_a^T) @ B_a^T * (alpha_a / rank_a)

where ``R_a`` are the batch rows routed to adapter ``a`` (rows routed to ``None`` get the
base model only). Gradients of ``A_a`` / ``B_a`` only receive contributions from the rows
in ``R_a``, so runs never leak gradients into each other; the base weights are frozen.

The package, in the shape of vLLM's ``lora/`` and PEFT's ``tuners/lora/``:

============  ===========================================================================
``config``    :class:`LoraSpec` (rank, alpha, seed, targets) and its PEFT config mapping
``routing``   :class:`LoraRouting`: rows -> adapters as segment tensors, the kernels chosen
              once for them, and the one call a layer makes (``add_lora``)
``ops``       the delta kernels (single, gather/scatter, stacked, grouped GEMM), the
              ``torch._grouped_mm`` self-check, and the selector with its settings
              (:class:`LoraKernelSettings`)
``layer``     :class:`MultiLoRALinear`: base matmul + ``routing.add_lora``
``model``     :class:`MultiLoRAModel`: model surgery, adapters, ``use_adapters``
``peft_io``   PEFT adapter files: save / read / load
============  ===========================================================================

Conventions
-----------
* Adapter parameters are float32 whatever the base dtype (master weights; the optimizer
  state lives in float32 too). The delta is computed in the layer input's dtype (bf16 for a
  bf16 base, as PEFT does), the weights cast on the fly; gradients reach the float32 params.
* Rows of one adapter that are contiguous in the batch are handled with slices (no
  gather/scatter), and several adapters' deltas are computed as one pair of grouped GEMMs
  (CUDA) or one stacked, row-masked pair of matmuls (see :class:`LoraKernelSettings`); the
  trainer orders rows by adapter. Any row order works (index_select / index_add fallback),
  just slower.
* Initialisation follows PEFT's default (``init_lora_weights=True``): ``A`` is
  kaiming-uniform with ``a=sqrt(5)``, ``B`` is zero, drawn from a CPU generator seeded with
  ``LoraSpec.seed`` so the same seed gives bit-identical adapters on any device.
* ``alpha`` defaults to 32 for every rank (:data:`DEFAULT_LORA_ALPHA`), the convention of
  Thinking Machines' Tinker / "LoRA Without Regret" (Schulman et al., 2025): with a fixed
  alpha the scale ``alpha/rank`` makes the best learning rate roughly rank-independent.
* Saved adapters use PEFT's layout (``peft_io``), so ``peft.PeftModel.from_pretrained`` and
  vLLM's LoRA loader read them.

Kernel selection is a setting of each model, :class:`LoraKernelSettings` (mode, stacked rank
cap), passed in (``MultiLoRAModel(base, LoraKernelSettings(mode="stacked"))``) or assigned to
``model.kernel_settings``; it is read when a routing is built, i.e. at each ``use_adapters``,
and no module global holds it.
"""

from openrl.model.lora.config import (
    ALL_TARGETS,
    ATTN_TARGETS,
    DEFAULT_LORA_ALPHA,
    MLP_TARGETS,
    PEFT_KEY_PREFIX,
    UNEMBED_TARGET,
    LoraSpec,
)
from openrl.model.lora.layer import MultiLoRALinear
from openrl.model.lora.model import MultiLoRAModel, PreparedAdapter
from openrl.model.lora.ops import KernelPlan, LoraKernelSettings, grouped_mm_support
from openrl.model.lora.peft_io import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    load_peft_adapter,
    read_peft_adapter,
    save_peft_adapter,
)
from openrl.model.lora.routing import LoraRouting, Router

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "ALL_TARGETS",
    "ATTN_TARGETS",
    "DEFAULT_LORA_ALPHA",
    "KernelPlan",
    "LoraKernelSettings",
    "LoraRouting",
    "LoraSpec",
    "MLP_TARGETS",
    "MultiLoRALinear",
    "MultiLoRAModel",
    "PreparedAdapter",
    "PEFT_KEY_PREFIX",
    "Router",
    "UNEMBED_TARGET",
    "grouped_mm_support",
    "load_peft_adapter",
    "read_peft_adapter",
    "save_peft_adapter",
]
