"""No mix of request shapes or modes breaks a worker (issue 22, "What it must do" item 1).

Several training runs at once (one thread each, unmodified ``tinker`` SDK against the stack) send
a randomized but seeded mix of requests: ``forward``, ``forward_backward`` (cross_entropy,
importance_sampling, ppo) and the sampling client's ``compute_logprobs``, with 1-16 datums of
1-``MAX_LEN`` tokens each, ``optim_step`` s and ``save_weights_and_get_sampling_client`` in
between; the runs have ranks 4-64, ``train_unembed`` on and off. Every request must succeed:
no failed future, every output finite and of its datum's length (logprobs <= 0).

What it targets: on the GPU the fused kernels (``torch.compile``) got a new guard for every new
combination of grad mode, ``requires_grad``, a size-1 batch dimension, ...; past the recompile
limit every later pass failed with ``FailOnRecompileLimitHit`` (issue 22, "What was seen" 1).
Lengths are log-uniform (many short datums, some long ones; the first request of every run has
one of 1 token and one of ``MAX_LEN``), so both ends of every dimension occur.

The plan of each run is drawn from its own ``random.Random`` (seeded), so the requests are the
same on every run of the test whatever the threads' interleaving; which requests share a trainer
pass depends on timing, and every outcome must pass.

Environment: ``OPENRL_TEST_MIX_REQUESTS`` (total requests, default 40; the GPU conformance run
uses 500), ``OPENRL_TEST_MIX_MAX_LEN`` (default 64; GPU 2048), ``OPENRL_TEST_MIX_RUNS`` (runs /
threads, default 4), ``OPENRL_TEST_MIX_SEED`` (default 22), ``OPENRL_TEST_MIX_TIMEOUT_S`` (per
request, default 600).
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from dataclasses import dataclass

import tinker
from tinker import types

from conftest import BASE_MODEL

REQUESTS = int(os.environ.get("OPENRL_TEST_MIX_REQUESTS", "40"))
MAX_LEN = int(os.environ.get("OPENRL_TEST_MIX_MAX_LEN", "64"))
RUNS = int(os.environ.get("OPENRL_TEST_MIX_RUNS", "4"))
SEED = int(os.environ.get("OPENRL_TEST_MIX_SEED", "22"))
TIMEOUT_S = float(os.environ.get("OPENRL_TEST_MIX_TIMEOUT_S", "600"))
RANKS = (4, 64, 8, 32, 16)
TOKENS = (100, 20000)  # token ids: real BPE tokens of the Qwen vocabulary
#: op -> weight in the mix (optim_step and save follow a forward_backward / optim with some chance).
#: "pair": a forward and a forward_backward of the run sent back to back before either result is
#: read (two requests; the trainer may run them as one pass with rows with and without grad).
OPS = {"forward": 3, "forward_backward": 4, "compute_logprobs": 2, "pair": 1}
LOSSES = ("cross_entropy", "cross_entropy", "importance_sampling", "ppo")


@dataclass
class Op:
    """One request of a run's plan.

    Attributes:
        kind: forward | forward_backward | compute_logprobs | pair | optim_step | save.
        lengths: the datums' token counts (model input lengths; compute_logprobs: one prompt;
            pair: the forward's datums then the forward_backward's, at least one each).
        loss_fn: for forward / forward_backward.
        seed: draws the datums' tokens and loss inputs.
    """

    kind: str
    lengths: list[int]
    loss_fn: str = "cross_entropy"
    seed: int = 0

    def __str__(self) -> str:
        return f"{self.kind}({self.loss_fn if self.kind in ('forward', 'forward_backward', 'pair') else ''} " \
               f"lengths={self.lengths})"

    @property
    def requests(self) -> int:
        return 2 if self.kind == "pair" else 1


def _length(rng: random.Random) -> int:
    """Log-uniform in [1, MAX_LEN]."""
    return min(MAX_LEN, max(1, int(math.exp(rng.uniform(0, math.log(MAX_LEN + 1))))))


def plan_run(run: int, n: int) -> list[Op]:
    """Ops of ``n`` requests of run ``run`` (deterministic in SEED and run)."""
    rng = random.Random(SEED * 1000 + run)
    ops: list[Op] = []
    while sum(op.requests for op in ops) < n:
        kind = rng.choices(list(OPS), weights=list(OPS.values()))[0]
        if kind == "pair" and sum(op.requests for op in ops) + 2 > n:
            kind = "forward"
        k = 1 if kind == "compute_logprobs" else rng.randint(2 if kind == "pair" else 1, 16)
        lengths = [_length(rng) for _ in range(k)]
        if not ops:  # both ends of the length range in the run's first request
            kind, lengths = "forward_backward", [1, MAX_LEN] + lengths[:14]
        ops.append(Op(kind, lengths, rng.choice(LOSSES), rng.randrange(2**31)))
        if kind in ("forward_backward", "pair") and rng.random() < 0.6:
            ops.append(Op("optim_step", [], seed=rng.randrange(2**31)))
            if rng.random() < 0.15:
                ops.append(Op("save", [], seed=rng.randrange(2**31)))
    while sum(op.requests for op in ops) > n:
        ops.pop()
    return ops


def _datum(rng: random.Random, n: int, loss_fn: str) -> types.Datum:
    toks = [rng.randrange(*TOKENS) for _ in range(n + 1)]
    inputs: dict = {"target_tokens": toks[1:]}
    if loss_fn == "cross_entropy":
        inputs["weights"] = [rng.choice((0.0, 1.0, 1.0, 0.5)) for _ in range(n)]
    else:  # sampler logprobs near a random model's (-ln 151936 = -11.9) and advantages
        inputs["logprobs"] = [-rng.uniform(10.0, 13.0) for _ in range(n)]
        inputs["advantages"] = [rng.uniform(-1.0, 1.0) for _ in range(n)]
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=inputs)


def _finite_logprobs(values, n: int, what: str) -> None:
    vals = list(values)
    assert len(vals) == n, f"{what}: {len(vals)} logprobs for {n} tokens"
    bad = [v for v in vals if not (math.isfinite(v) and v <= 1e-4)]
    assert not bad, f"{what}: logprobs not finite / not <= 0: {bad[:5]}"


def _run_one(tc, sampler_box: list, op: Op, run: int) -> None:
    """Send one request, wait for it (``TIMEOUT_S``) and check its result."""
    rng = random.Random(op.seed)
    if op.kind in ("forward", "forward_backward", "pair"):
        data = [_datum(rng, n, op.loss_fn) for n in op.lengths]
        if op.kind == "pair":
            half = len(data) // 2
            futs = [(tc.forward(data[:half], op.loss_fn), op.lengths[:half]),
                    (tc.forward_backward(data[half:], op.loss_fn), op.lengths[half:])]
        else:
            futs = [((tc.forward if op.kind == "forward" else tc.forward_backward)(data, op.loss_fn), op.lengths)]
        for fut, lengths in futs:
            res = fut.result(timeout=TIMEOUT_S)
            got = len(res.loss_fn_outputs)
            assert got == len(lengths), f"{got} outputs for {len(lengths)} datums"
            for i, (out, n) in enumerate(zip(res.loss_fn_outputs, lengths)):
                _finite_logprobs(out["logprobs"].tolist(), n, f"datum {i}")
            assert math.isfinite(res.metrics["loss:sum"]), res.metrics
    elif op.kind == "optim_step":
        adam = types.AdamParams(learning_rate=rng.choice((1e-5, 1e-4, 1e-3)), weight_decay=rng.choice((0.0, 0.01)),
                                grad_clip_norm=rng.choice((0.0, 1.0)))
        res = tc.optim_step(adam).result(timeout=TIMEOUT_S)
        assert all(math.isfinite(v) for v in (res.metrics or {}).values()), res.metrics
    elif op.kind == "save":
        sampler_box[0] = tc.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
    elif op.kind == "compute_logprobs":
        (n,) = op.lengths
        prompt = types.ModelInput.from_ints([rng.randrange(*TOKENS) for _ in range(n)])
        lps = sampler_box[0].compute_logprobs(prompt).result(timeout=TIMEOUT_S)
        assert len(lps) == n and lps[0] is None, (len(lps), n, lps[:1])
        _finite_logprobs(lps[1:], n - 1, "compute_logprobs")
    else:
        raise AssertionError(op.kind)


def _worker(service: tinker.ServiceClient, run: int, ops: list[Op], failures: list, done: list) -> None:
    """One run: create it (rank ``RANKS[run % 5]``, train_unembed on for even runs), then its
    ops in order; every failure is kept (the run goes on), with the op that failed."""
    try:
        tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=RANKS[run % len(RANKS)],
                                                 seed=SEED + run, train_unembed=run % 2 == 0).result(timeout=TIMEOUT_S)
        sampler_box = [service.create_sampling_client(base_model=BASE_MODEL).result(timeout=TIMEOUT_S)]
    except Exception as e:  # noqa: BLE001 - reported by the test
        failures.append((run, -1, "create", f"{type(e).__name__}: {e}"))
        return
    for i, op in enumerate(ops):
        try:
            t0 = time.monotonic()
            _run_one(tc, sampler_box, op, run)
            done.extend([(op.kind, time.monotonic() - t0)] * op.requests)
        except Exception as e:  # noqa: BLE001 - every failure is reported, not only the first
            failures.append((run, i, str(op), f"{type(e).__name__}: {str(e)[:300]}"))


def test_request_mix_never_fails(stack, api_key):
    """``REQUESTS`` requests of ``RUNS`` concurrent runs (module doc): all succeed."""
    service = tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)
    per_run = [REQUESTS // RUNS + (1 if r < REQUESTS % RUNS else 0) for r in range(RUNS)]
    plans = [plan_run(r, n) for r, n in enumerate(per_run)]
    failures: list = []
    done: list[tuple[str, float]] = []
    threads = [threading.Thread(target=_worker, args=(service, r, plans[r], failures, done), daemon=True)
               for r in range(RUNS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kinds = {k: sum(op.requests for p in plans for op in p if op.kind == k) for k in (*OPS, "optim_step", "save")}
    tokens = sum(sum(op.lengths) for p in plans for op in p)
    print(f"{REQUESTS} requests ({kinds}), {tokens} tokens, max length {MAX_LEN}: {len(done)} succeeded, "
          f"{len(failures)} failed; seconds waited per kind (threads overlap): "
          f"{ {k: round(sum(t for kk, t in done if kk == k), 1) for k in kinds} }")
    assert not failures, f"{len(failures)} of {REQUESTS} requests failed; first ones: {failures[:8]}"
    assert len(done) == REQUESTS
