"""The unit tests' one micro model: a 2-layer Qwen3 (hidden 32, vocabulary 512) written with
the real ``save_pretrained``, so engines load it through ``from_pretrained`` as they load any
model (fixture ``micro_model_dir`` in tests/conftest.py). The stack tests use the larger
offline model of ``models_dir``."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

MICRO_VOCAB = 512


def write_micro_qwen3(directory: Path, *, max_positions: int = 256, tie: bool = True,
                      sharp_head: bool = False, **config) -> Path:
    """Write the micro model (seed 0) to ``directory``; ``sharp_head`` draws the LM head from
    N(0, 0.5) for sharper logits (fewer near-ties when sampling). Returns ``directory``."""
    cfg = Qwen3Config(vocab_size=MICRO_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=max_positions, tie_word_embeddings=tie, **config)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    if sharp_head:
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 0.5)
    model.save_pretrained(str(directory))
    return Path(directory)
