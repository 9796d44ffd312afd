"""Sampler function: sampling and prompt logprobs from base models and LoRA snapshots (see function.py)."""


def new():
    """The Function instance (Knative Functions "instanced" template entry point)."""
    from functions.sampler.function import SamplerFunction

    return SamplerFunction()
