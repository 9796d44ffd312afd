"""Sampler function: sampling and prompt logprobs from base models and LoRA snapshots (see function.py)."""


def new():
    """The Function instance (Knative Functions "instanced" template entry point).

    Sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` unless set, before anything in this process asks
    ``torch.cuda.is_available()``: the check then reads NVML instead of initialising the CUDA
    driver, so vLLM's engine-core process can be forked from this one (see
    :func:`functions.sampler.backends.vllm_settings.configure_vllm_env`).
    """
    import os

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    from functions.sampler.function import SamplerFunction

    return SamplerFunction()
