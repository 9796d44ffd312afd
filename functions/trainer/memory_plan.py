"""How many padded tokens one micro-batch may hold on the trainer's CUDA device.

A pass's micro-batches used to be capped only by ``TrainerEngine.max_tokens`` (32,768 padded
tokens), and a CUDA out-of-memory halved that cap for good. On a GPU shared with the vLLM
sampler (the trainer may allocate ``OPENRL_TRAINER_GPU_MEMORY`` of it) an 8-run RL pass of
Qwen3-4B ran out of memory twice before settling at one 3,056-token row per micro-batch, and
kept that cap for every later pass, SFT included (docs/benchmarks.md, issue 31, fourth session:
8 runs at 3,056-token micro-batches 2.37 s, at 16,384 1.20 s on the same GPU).

:class:`ActivationBudget` plans from memory instead: the headroom left under the process's cap
(``limit - torch.cuda.memory_allocated()``, where ``limit`` is
``torch.cuda.get_per_process_memory_fraction() x total``, and never more than the device has
free plus what the caching allocator holds unused), divided by the bytes one padded token
needs, times a safety margin. The bytes per token start from an estimate off the model's
config and are replaced by what the allocator's peak shows for each micro-batch run
(``max_memory_allocated`` after the micro-batch's backward minus ``memory_allocated`` before
it, per padded token); an out-of-memory raises the estimate so that the next plan holds at
most half the tokens that failed. Rows that train keep every layer's inputs for the backward;
forward-only rows keep none, so the two have separate estimates.

CPU engines have no budget (``ActivationBudget.for_engine`` returns None): their micro-batches
stay capped by ``max_tokens`` alone, so CPU numerics and tests are unchanged.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

#: fraction of the computed headroom a plan may use (the caching allocator's fragmentation,
#: transient buffers that the per-token estimate does not scale with)
MARGIN = 0.85
#: a micro-batch of fewer padded tokens does not update the estimate (its fixed costs, e.g. a
#: vocabulary-projection chunk, would dominate the per-token figure)
MIN_MEASURED_TOKENS = 512


def estimate_bytes_per_token(config, dtype: torch.dtype) -> tuple[float, float]:
    """A priori activation bytes per padded token ``(training rows, forward-only rows)``.

    Training: every decoder layer keeps, per token, its inputs for the backward: about
    six hidden-size vectors (the two RMSNorms' inputs and outputs, the residual adds), q and the
    attention output (``num_attention_heads x head_dim`` each), k and v (``num_key_value_heads x
    head_dim`` each) and four intermediate-size vectors (gate, up, their SiLU product, down's
    input), in ``dtype``, times 1.25 for the LoRA deltas' intermediates and the attention kernel's
    statistics. For Qwen3-4B's shapes this is 5.8 MB a token; the H100 measured about 4.3 to
    4.9 MB (docs/benchmarks.md, issue 31, fourth session), so the first plan errs on the safe
    side until a measured micro-batch replaces it. Forward-only: one layer's transients (the
    training figure over the layer count) times four.
    """
    h = int(getattr(config, "hidden_size", 0) or 0)
    inter = int(getattr(config, "intermediate_size", 0) or 0) or 4 * h
    layers = int(getattr(config, "num_hidden_layers", 0) or 0) or 1
    heads = int(getattr(config, "num_attention_heads", 0) or 0) or 1
    head_dim = int(getattr(config, "head_dim", 0) or 0) or max(1, h // heads)
    kv = int(getattr(config, "num_key_value_heads", 0) or 0) or heads
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = elem * (6 * h + 2 * heads * head_dim + 2 * kv * head_dim + 4 * inter) * 1.25
    return per_layer * layers, per_layer * 4


class ActivationBudget:
    """The micro-batch token cap of one CUDA trainer engine (see the module docstring).

    Args:
        device: the engine's CUDA device.
        bytes_per_token: the a priori ``(training, forward-only)`` estimates
            (:func:`estimate_bytes_per_token`).
        margin: the fraction of the headroom a plan may fill.
        min_measured_tokens: smaller micro-batches do not update the estimate.
    """

    def __init__(self, device: torch.device, bytes_per_token: tuple[float, float], margin: float = MARGIN,
                 min_measured_tokens: int = MIN_MEASURED_TOKENS):
        if device.type == "cuda" and device.index is None:  # some torch.cuda calls want the index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.margin = float(margin)
        self.min_measured_tokens = int(min_measured_tokens)
        self.bytes_per_token = {True: float(bytes_per_token[0]), False: float(bytes_per_token[1])}
        self.measured = {True: False, False: False}
        self._before = 0
        #: the allocator's highest ``max_memory_allocated`` (bytes) over the micro-batches since
        #: :meth:`reset_peak`: :meth:`start` resets torch's own peak per micro-batch, so a caller
        #: that wants a pass's peak (a benchmark) reads this instead
        self.peak_allocated = 0

    @classmethod
    def for_engine(cls, device: torch.device, config, dtype: torch.dtype) -> "ActivationBudget | None":
        """A budget for a CUDA engine; None on any other device."""
        if device.type != "cuda":
            return None
        return cls(device, estimate_bytes_per_token(config, dtype))

    def headroom(self) -> int:
        """Bytes this process may still allocate: under its per-process cap, and within what the
        device has free plus what the caching allocator holds but does not use."""
        free, total = torch.cuda.mem_get_info(self.device)
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = float(get_fraction(self.device)) if get_fraction is not None else 1.0
        allocated = torch.cuda.memory_allocated(self.device)
        unused = torch.cuda.memory_reserved(self.device) - allocated
        return max(0, min(int(fraction * total) - allocated, free + unused))

    def cap(self, grad: bool) -> int:
        """Most padded tokens one micro-batch of this kind should hold now (at least 1)."""
        return max(1, int(self.margin * self.headroom() / self.bytes_per_token[grad]))

    def start(self) -> None:
        """Call before a micro-batch: resets the allocator's peak."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self._before = torch.cuda.memory_allocated(self.device)

    def finish(self, tokens: int, grad: bool) -> None:
        """Call after a micro-batch of ``tokens`` padded tokens (its backward done): the bytes per
        token it needed replace the estimate (micro-batches under ``min_measured_tokens`` are
        not counted)."""
        peak = torch.cuda.max_memory_allocated(self.device)
        self.peak_allocated = max(self.peak_allocated, peak)
        if tokens < self.min_measured_tokens:
            return
        used = peak - self._before
        if used > 0:
            self.bytes_per_token[grad] = used / tokens
            self.measured[grad] = True

    def reset_peak(self) -> None:
        """Forget :attr:`peak_allocated` (torch's peak is reset with it)."""
        self.peak_allocated = 0
        torch.cuda.reset_peak_memory_stats(self.device)

    def out_of_memory(self, tokens: int, grad: bool) -> None:
        """A micro-batch of ``tokens`` padded tokens ran out of memory: raise the estimate so the
        next plan holds at most half as many."""
        at_most = max(1, tokens // 2)
        need = self.margin * self.headroom() / at_most
        self.bytes_per_token[grad] = max(self.bytes_per_token[grad] * 1.5, need)
        log.warning("CUDA out of memory in a micro-batch of %d padded tokens: now planning %.2f MB a token "
                    "(micro-batches of at most %d tokens with the memory free now)",
                    tokens, self.bytes_per_token[grad] / 1e6, self.cap(grad))
