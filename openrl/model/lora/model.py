"""Model surgery: a frozen causal LM whose target linears carry many LoRA adapters, chosen
per batch row (the role of PEFT's ``tuners/lora/model.py``)."""

from __future__ import annotations

import contextlib
import math
import secrets
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from openrl.errors import UserError
from openrl.model.lora.config import ALL_TARGETS, PEFT_KEY_PREFIX, LoraSpec
from openrl.model.lora.layer import MultiLoRALinear
from openrl.model.lora.ops import LoraKernelSettings
from openrl.model.lora.pass_weights import PassWeights
from openrl.model.lora.routing import LoraRouting, Router


@dataclass(frozen=True)
class PreparedAdapter:
    """A new adapter's tensors before :meth:`MultiLoRAModel.add_adapter` attaches them.

    Attributes:
        spec: the spec with ``seed`` and ``alpha`` resolved.
        tensors: ``(layer path, A [r, in], B [out, r])`` per targeted layer, float32 on the
            model's device, in the model's layer order.
    """

    spec: LoraSpec
    tensors: list[tuple[str, Tensor, Tensor]]


class MultiLoRAModel(nn.Module):
    """A frozen causal LM whose target linears carry many LoRA adapters, chosen per row.

    Args:
        base: a ``transformers`` causal LM (e.g. ``Qwen3ForCausalLM``). Its parameters are
            frozen (``requires_grad=False``) and every ``nn.Linear`` whose attribute name is
            in :data:`~openrl.model.lora.config.ALL_TARGETS` is replaced, once, by a
            :class:`~openrl.model.lora.layer.MultiLoRALinear`.
        kernel_settings: how the layers apply several adapters in one batch
            (:class:`~openrl.model.lora.ops.LoraKernelSettings`; default: "auto"). Kept as
            :attr:`kernel_settings`, which may be reassigned between routings.

    Typical use::

        m = MultiLoRAModel(base)
        m.add_adapter("run-a", LoraSpec(rank=8, seed=0))
        with m.use_adapters(["run-a", None, "run-a"]):
            logits = m(input_ids, attention_mask).logits   # [3, T, V]

    Thread safety: the per-row routing is state of the model (set by :meth:`use_adapters`);
    run one forward at a time per model instance.
    """

    def __init__(self, base: nn.Module, kernel_settings: LoraKernelSettings | None = None):
        super().__init__()
        self.base = base
        #: how layers apply several adapters in one batch (read at each :meth:`use_adapters`)
        self.kernel_settings = kernel_settings or LoraKernelSettings()
        for p in base.parameters():
            p.requires_grad_(False)
        self._router = Router()
        self._pass_weights: PassWeights | None = None
        self._layers: dict[str, MultiLoRALinear] = {}  # module path in base -> layer
        self._specs: dict[str, LoraSpec] = {}
        for path, module in list(base.named_modules()):
            leaf = path.rsplit(".", 1)[-1]
            if leaf in ALL_TARGETS and type(module) is nn.Linear:
                wrapped = MultiLoRALinear(module, self._router)
                parent = base.get_submodule(path.rsplit(".", 1)[0]) if "." in path else base
                setattr(parent, leaf, wrapped)
                self._layers[path] = wrapped

    # ----------------------------------------------------------------- adapters

    @property
    def device(self) -> torch.device:
        """Device of the base weights."""
        return next(self.base.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the base weights (adapters are float32 whatever this is)."""
        return next(self.base.parameters()).dtype

    def adapter_names(self) -> list[str]:
        """Names of the adapters, in creation order."""
        return list(self._specs)

    def to_device(self, device: torch.device | str) -> "MultiLoRAModel":
        """Move the base model *and* every adapter (parameters and gradients) to ``device``.

        ``Module.to`` alone leaves the adapters where they are: ``MultiLoRALinear`` keeps them in
        plain dicts, not as registered parameters. Each adapter keeps its ``nn.Parameter``
        object (``.data`` is swapped), so optimizers holding it stay valid; values and dtypes are
        unchanged (a round trip is bit for bit).
        """
        device = torch.device(device)
        self.to(device)
        self.map_adapters(lambda t: t.to(device))
        return self

    def map_adapters(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Replace every adapter parameter's data and gradient by ``fn`` of it (same shape and
        dtype), keeping the ``nn.Parameter`` objects (``.data`` swapped)."""
        for name in self._specs:
            for _, p in self.named_adapter_parameters(name):
                g = p.grad
                p.grad = None
                p.data = fn(p.data)
                if g is not None:
                    p.grad = fn(g)

    def has_adapter(self, name: str) -> bool:
        """Whether adapter ``name`` exists."""
        return name in self._specs

    def adapter_spec(self, name: str) -> LoraSpec:
        """The adapter's spec with ``alpha`` and ``seed`` resolved (never None).

        Raises:
            KeyError: unknown adapter.
        """
        return replace(self._spec(name))

    def _spec(self, name: str) -> LoraSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise KeyError(f"no adapter named {name!r}") from None

    def _target_layers(self, spec: LoraSpec) -> list[tuple[str, MultiLoRALinear]]:
        targets = set(spec.targets())
        return [(p, l) for p, l in self._layers.items() if p.rsplit(".", 1)[-1] in targets]

    def prepare_adapter(self, spec: LoraSpec) -> "PreparedAdapter":
        """A new adapter's tensors, not attached yet (:meth:`add_adapter` attaches them).

        ``A`` [r, in] is kaiming-uniform with ``a=sqrt(5)`` (PEFT's default,
        U(-1/sqrt(in), 1/sqrt(in))) from a CPU generator seeded with ``spec.seed`` (a random
        seed is drawn and recorded if None; modules in ``named_modules`` order, ``A`` only),
        so the same seed gives bit-identical adapters on any device; ``B`` [out, r] is zero,
        so a fresh adapter leaves the model unchanged. Both float32, on the model's device.

        Touches no state of the model (its layer table is fixed at construction): the trainer
        runs it outside its engine lock, so a ``create_model`` (a whole one took 0.3 s alone on
        an H100 at rank 32, Qwen3-4B shapes: about 31 M random floats on the CPU and 0.12 GB
        copied to the device) does not hold up packed passes.

        Raises:
            UserError: invalid spec (``lora_config.*``), or no layer of the model matches.
        """
        spec.validate()
        seed = spec.seed if spec.seed is not None else secrets.randbits(63)
        spec = replace(spec, seed=int(seed), alpha=spec.resolved_alpha)
        layers = self._target_layers(spec)
        if not layers:
            raise UserError("lora_config", "no module of this model matches the requested LoRA targets")
        gen = torch.Generator(device="cpu").manual_seed(int(seed) % (2**63))
        device = self.device
        tensors = []
        for path, layer in layers:
            a = torch.empty(spec.rank, layer.in_features, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            b = torch.zeros(layer.out_features, spec.rank, dtype=torch.float32, device=device)
            tensors.append((path, a.to(device), b))
        return PreparedAdapter(spec, tensors)

    def add_adapter(self, name: str, spec: LoraSpec | None = None, *,
                    prepared: "PreparedAdapter | None" = None) -> list[nn.Parameter]:
        """Create adapter ``name`` on every targeted layer: ``prepared``
        (:meth:`prepare_adapter`'s result, made beforehand), else :meth:`prepare_adapter` of ``spec``.

        Returns:
            The new trainable parameters (float32, ``requires_grad=True``), in
            :meth:`adapter_parameters` order.

        Raises:
            ValueError: an adapter of that name exists, or neither ``spec`` nor ``prepared`` given.
            UserError: invalid spec (``lora_config.*``), or no layer of the model matches.
        """
        if name in self._specs:
            raise ValueError(f"adapter {name!r} already exists")
        if prepared is None:
            if spec is None:
                raise ValueError("add_adapter needs a spec or a prepared adapter")
            prepared = self.prepare_adapter(spec)
        for path, a, b in prepared.tensors:
            layer = self._layers[path]
            layer.lora_A[name] = nn.Parameter(a)
            layer.lora_B[name] = nn.Parameter(b)
            layer.scaling[name] = prepared.spec.scaling
        self._specs[name] = prepared.spec
        return self.adapter_parameters(name)

    def remove_adapter(self, name: str) -> None:
        """Drop adapter ``name`` from every layer (no-op if absent)."""
        if self._specs.pop(name, None) is None:
            return
        for layer in self._layers.values():
            layer.lora_A.pop(name, None)
            layer.lora_B.pop(name, None)
            layer.scaling.pop(name, None)

    def rename_adapter(self, old: str, new: str) -> None:
        """Rename adapter ``old`` to ``new`` (same parameter objects).

        Raises:
            KeyError: ``old`` does not exist. ValueError: ``new`` exists.
        """
        spec = self._spec(old)
        if new in self._specs:
            raise ValueError(f"adapter {new!r} already exists")
        for layer in self._layers.values():
            if old in layer.lora_A:
                layer.lora_A[new] = layer.lora_A.pop(old)
                layer.lora_B[new] = layer.lora_B.pop(old)
                layer.scaling[new] = layer.scaling.pop(old)
        del self._specs[old]
        self._specs[new] = spec

    def named_adapter_parameters(self, name: str) -> list[tuple[str, nn.Parameter]]:
        """``(peft key, parameter)`` pairs of adapter ``name``, in a fixed order
        (module order of the base model, ``lora_A`` before ``lora_B``); keys are
        ``base_model.model.<module path>.lora_{A,B}.weight``.

        Raises:
            KeyError: unknown adapter.
        """
        self._spec(name)
        out = []
        for path, layer in self._layers.items():
            if name in layer.lora_A:
                out.append((f"{PEFT_KEY_PREFIX}{path}.lora_A.weight", layer.lora_A[name]))
                out.append((f"{PEFT_KEY_PREFIX}{path}.lora_B.weight", layer.lora_B[name]))
        return out

    def adapter_parameters(self, name: str) -> list[nn.Parameter]:
        """Trainable parameters of adapter ``name`` (see :meth:`named_adapter_parameters`)."""
        return [p for _, p in self.named_adapter_parameters(name)]

    # ------------------------------------------------------------------ routing

    @contextlib.contextmanager
    def use_adapters(
        self, row_adapters: Sequence[str | None], no_grad_adapters: Sequence[str] = ()
    ) -> Iterator[LoraRouting]:
        """Route batch row ``i`` of forwards inside the block through ``row_adapters[i]``.

        Args:
            row_adapters: one entry per batch row: an adapter name, or None for the base
                model alone.
            no_grad_adapters: adapters whose parameters are used detached inside the block
                (their rows still get the LoRA delta, but no gradient reaches the adapter).

        Yields the :class:`LoraRouting` built for the block (kernels chosen once, here).
        Nesting is allowed; the previous routing is restored on exit.

        Raises:
            KeyError: a named adapter does not exist.
        """
        for name in set(row_adapters):
            if name is not None and name not in self._specs:
                raise KeyError(f"no adapter named {name!r}")
        routing = LoraRouting(row_adapters, no_grad_adapters, device=self.device, dtype=self.dtype,
                              settings=self.kernel_settings, pass_weights=self._pass_weights)
        with self.routed(routing):
            yield routing

    @contextlib.contextmanager
    def pass_weights(self) -> Iterator[PassWeights]:
        """Inside the block, every :meth:`use_adapters` routing shares one
        :class:`~openrl.model.lora.pass_weights.PassWeights`: each adapter's compute-dtype cast
        is made at its first use and reused by the later micro-batches of the pass
        (same values and gradients; see that module). Blocks nest (the outer cache is kept);
        the cache is dropped on exit, freeing its copies."""
        if self._pass_weights is not None:
            yield self._pass_weights
            return
        self._pass_weights = PassWeights()
        try:
            yield self._pass_weights
        finally:
            self._pass_weights = None

    @property
    def current_routing(self) -> LoraRouting | None:
        """The routing forwards use now (None: the base model alone)."""
        return self._router.current

    @contextlib.contextmanager
    def routed(self, routing: LoraRouting | None) -> Iterator[None]:
        """Make ``routing`` (built earlier by :meth:`use_adapters`) current inside the block,
        e.g. when activation checkpointing recomputes a forward after the block ended."""
        prev = self._router.current
        self._router.current = routing
        try:
            yield
        finally:
            self._router.current = prev

    # ------------------------------------------------------------------ forward

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kw):
        """Run the base model (HF output, ``.logits`` [B, T, V]) under the current routing.

        ``use_cache`` defaults to False. Rows are routed by the enclosing
        :meth:`use_adapters`; outside one, the base model alone runs.
        """
        kw.setdefault("use_cache", False)
        return self.base(input_ids=input_ids, attention_mask=attention_mask, **kw)

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Final (normed) hidden states [B, T, H] of the decoder, before ``lm_head``."""
        out = self.base.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return out.last_hidden_state

    @property
    def lm_head(self) -> nn.Module:
        """The output projection (a :class:`MultiLoRALinear` when it is a LoRA target)."""
        return self.base.get_output_embeddings()

    # --------------------------------------------------------------------- PEFT view

    def peft_state_dict(self, name: str) -> dict[str, Tensor]:
        """Adapter ``name`` as PEFT tensors: ``base_model.model.<path>.lora_A.weight`` [r, in]
        and ``...lora_B.weight`` [out, r], float32, detached CPU copies.

        Raises:
            KeyError: unknown adapter.
        """
        return {k: p.detach().to("cpu", copy=True).contiguous() for k, p in self.named_adapter_parameters(name)}

    def peft_config(self, name: str) -> dict:
        """``adapter_config.json`` content for adapter ``name`` (a ``peft.LoraConfig``).

        Raises:
            KeyError: unknown adapter.
        """
        spec = self._spec(name)
        targets = sorted({p.rsplit(".", 1)[-1] for p, _ in self._target_layers(spec)})
        return spec.to_peft_config(targets, getattr(self.base, "name_or_path", None) or None)

    def load_peft_state_dict(
        self, name: str, state_dict: Mapping[str, Tensor], config: Mapping, seed: int | None = None
    ) -> None:
        """(Re)create adapter ``name`` from PEFT tensors and its ``adapter_config.json``.

        Args:
            state_dict: keys as produced by :meth:`peft_state_dict` (PEFT's
                ``.lora_A.default.weight`` style is accepted too).
            config: the adapter config (``r``, ``lora_alpha``, ``target_modules``).
            seed: recorded in the adapter's spec (0 if None; the weights come from ``state_dict``).

        Raises:
            UserError: config/tensors do not fit this base model (field ``checkpoint``);
                the previous adapter ``name``, if any, is then untouched.
        """
        spec = LoraSpec.from_peft_config(config, seed=seed)
        sd = {k.replace(".lora_A.default.weight", ".lora_A.weight").replace(".lora_B.default.weight", ".lora_B.weight"): v
              for k, v in state_dict.items()}
        tmp = f"{name}\x00loading"
        self.remove_adapter(tmp)
        try:
            self.add_adapter(tmp, replace(spec, seed=seed if seed is not None else 0))
            expected = dict(self.named_adapter_parameters(tmp))
            missing = sorted(set(expected) - set(sd))
            if missing:
                raise UserError("checkpoint", f"adapter weights missing {len(missing)} tensors, e.g. {missing[0]}")
            extra = sorted(k for k in sd if ".lora_" in k and k not in expected)
            if extra:
                raise UserError("checkpoint",
                                f"adapter has tensors for modules this model lacks, e.g. {extra[0][len(PEFT_KEY_PREFIX):]}")
            with torch.no_grad():
                for k, p in expected.items():
                    t = sd[k]
                    if tuple(t.shape) != tuple(p.shape):
                        raise UserError("checkpoint", f"{k}: shape {tuple(t.shape)} != expected {tuple(p.shape)}")
                    p.copy_(t.to(device=p.device, dtype=p.dtype))
        except BaseException:
            self.remove_adapter(tmp)  # the previous adapter `name`, if any, is untouched
            raise
        self.remove_adapter(name)
        self.rename_adapter(tmp, name)
