"""Model code: the registry, offline builds, device/dtype choice, LoRA layers and logprob numerics."""
