"""The fused-kernel wrapper's safety rules (openrl/model/kernels.py), on CPU.

Liger's Triton kernels need CUDA, so the kernels themselves are exercised in the GPU
conformance run (bench/gpu_conformance.py); here stand-in kernels (plain functions that raise
or answer wrongly, no mock library) check what happens around them: a kernel that raises
falls back to the eager formula for that call and from then on, one that does not match its
formula at set-up or cannot be imported stays eager with the reason in its status.
"""

from __future__ import annotations

import torch

from openrl.model import kernels as K


def _kernel(fast):
    k = K._Kernel("silu_mul", K._silu_mul_ref, lambda: fast, (0, 1))
    return k


def test_a_kernel_that_raises_falls_back_for_that_call_and_after():
    calls = []

    def boom(g, u):
        calls.append(1)
        raise RuntimeError("triton: out of resources for this block size")

    k = _kernel(boom)
    k.fast, k.status = boom, "liger"
    g, u = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(k(g, u), K._silu_mul_ref(g, u))
    assert k.fast is None and k.status.startswith("failed at run time: RuntimeError: triton: out of resources")
    assert k.fallbacks == 1
    torch.testing.assert_close(k(g, u), K._silu_mul_ref(g, u))
    assert len(calls) == 1  # not retried once it failed


def test_check_rejects_a_kernel_that_differs_from_its_formula():
    k = _kernel(lambda g, u: K._silu_mul_ref(g, u) * 1.1)
    K._check(k, [(torch.randn(4, 16), torch.randn(4, 16))], torch.device("cpu"))
    assert k.fast is None and k.status.startswith("failed: RuntimeError: silu_mul differs from eager")


def test_check_keeps_a_kernel_that_matches_forward_backward_and_no_grad():
    k = _kernel(lambda g, u: g * torch.sigmoid(g) * u)  # the same formula written differently
    K._check(k, [(torch.randn(1, 16), torch.randn(1, 16)), (torch.randn(5, 16), torch.randn(5, 16))],
             torch.device("cpu"))
    assert k.status == "liger" and k.fast is not None


def test_check_without_liger_stays_eager_and_says_why():
    def missing():
        raise ImportError("No module named 'liger_kernel'")

    k = K._Kernel("rope", K._rope_ref, missing, (0, 1))
    K._check(k, [], torch.device("cpu"))
    assert k.fast is None and k.status == "eager (liger-kernel not importable: No module named 'liger_kernel')"


def test_rope_tables_repeat_their_halves_like_transformers():
    """Liger's rope reads one half of cos/sin: the check's tables must be shaped like real ones."""
    cos, sin = K.rope_tables(2, 5, 8, torch.Generator().manual_seed(0))
    assert cos.shape == (2, 5, 8)
    torch.testing.assert_close(cos[..., :4], cos[..., 4:])
    torch.testing.assert_close(sin[..., :4], sin[..., 4:])
    torch.testing.assert_close(cos ** 2 + sin ** 2, torch.ones_like(cos))


def test_check_accepts_a_kernel_whose_backward_overwrites_its_inputs():
    """Liger's SiLU*up backward writes its gradients into its inputs' buffers (in the model
    nothing reads them afterwards). The set-up check must give every pass fresh inputs: on
    the H200 it compared a no-grad forward on the overwritten buffers and rejected the kernel
    (rel err 1.34), so the MLP ran eager."""

    class InPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, g, u):
            ctx.save_for_backward(g, u)
            return K._silu_mul_ref(g.detach(), u.detach())

        @staticmethod
        def backward(ctx, dy):
            g, u = ctx.saved_tensors
            sg = torch.sigmoid(g)
            dg = dy * u * sg * (1 + g * (1 - sg))
            du = dy * g * sg
            g.data.copy_(dg)  # the gradients land in the inputs' storage, as Liger's kernel does
            u.data.copy_(du)
            return g, u

    k = _kernel(lambda g, u: InPlace.apply(g, u))
    K._check(k, [(torch.randn(3, 16), torch.randn(3, 16))], torch.device("cpu"))
    assert k.status == "liger", k.status
