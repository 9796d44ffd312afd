"""functions.trainer.optim.step_many: several runs stepped together equal each run stepped by
``torch.optim.AdamW`` (single-tensor path, ``clip_grad_norm_`` first) alone, bit for bit,
whatever the mix of hyperparameters and step counts (CPU, float32)."""

from __future__ import annotations

import torch

from functions.trainer.optim import AdamConfig, RunOptimizer, step_many

SHAPES = [(4, 16), (32, 4), (7,), (3, 5)]


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(seed: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + step)
    return [torch.randn(s, generator=g) * (3.0 if step % 2 else 0.1) for s in SHAPES]


CFGS = [
    AdamConfig(learning_rate=1e-2),
    AdamConfig(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0),
    AdamConfig(learning_rate=5e-2, beta1=0.0, beta2=0.5, grad_clip_norm=100.0),
]


def test_runs_stepped_together_equal_torch_adamw_alone():
    ours = [RunOptimizer([(f"w{i}", p) for i, p in enumerate(_params(r))]) for r in range(len(CFGS))]
    refs = [_params(r) for r in range(len(CFGS))]
    torch_opts = [
        torch.optim.AdamW(ps, lr=c.learning_rate, betas=(c.beta1, c.beta2), eps=c.eps,
                          weight_decay=c.weight_decay, foreach=False)
        for ps, c in zip(refs, CFGS)
    ]
    # a run whose state was loaded with a different step count per tensor (a checkpoint
    # written elsewhere): the bias corrections follow each tensor's own count
    for opt, tor in ((ours[2], torch_opts[2]), ):
        for k, (p, q) in enumerate(zip(opt.params, refs[2])):
            for o, pp in ((opt.opt, p), (tor, q)):
                o.state[pp]["step"] = torch.tensor(float(3 * k), dtype=torch.float32)
                o.state[pp]["exp_avg"] = torch.full_like(pp, 0.01 * k)
                o.state[pp]["exp_avg_sq"] = torch.full_like(pp, 0.02 * k)
    for step in range(4):
        active = [r for r in range(len(CFGS)) if not (step == 1 and r == 0)]  # run 0 sits one step out
        for r in active:
            for p, q, g in zip(ours[r].params, refs[r], _grads(r, step)):
                p.grad, q.grad = g.clone(), g.clone()
        metrics = step_many([(ours[r], CFGS[r]) for r in active])
        for r, m in zip(active, metrics):
            want_norm = float(torch.nn.utils.clip_grad_norm_(refs[r], CFGS[r].grad_clip_norm or float("inf")))
            torch_opts[r].step()
            torch_opts[r].zero_grad()
            assert m["grad_norm:mean"] == want_norm
            assert m["learning_rate:mean"] == CFGS[r].learning_rate
        for r in range(len(CFGS)):
            for p, q in zip(ours[r].params, refs[r]):
                assert torch.equal(p.detach(), q.detach()), (step, r)
                assert p.grad is None
    for r in range(len(CFGS)):
        for p, q in zip(ours[r].params, refs[r]):
            assert torch.equal(ours[r].opt.state[p]["step"], torch_opts[r].state[q]["step"])


def test_a_run_without_gradients_still_decays_and_counts():
    p = torch.nn.Parameter(torch.ones(3))
    opt = RunOptimizer([("w", p)])
    out = step_many([(opt, {"learning_rate": 0.1, "weight_decay": 0.5})])
    assert out == [{"grad_norm:mean": 0.0, "learning_rate:mean": 0.1}]
    assert torch.allclose(p.detach(), torch.full((3,), 0.95))
    assert float(opt.opt.state[p]["step"]) == 1.0 and opt.steps == 1
