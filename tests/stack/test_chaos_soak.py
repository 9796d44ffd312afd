"""Chaos soak, CI size (issue 17 item 2): 4 concurrent SDK training runs (plus save / sample
every 2 steps) on a supervised stack while one fault of each kind hits it at seeded random
moments: the trainer SIGKILLed and SIGTERMed, the sampler, the gateway and nats-server
SIGKILLed; once per binding (JetStream pull workers, and HTTP push receivers fed by the
local dispatcher, the Knative path).

Nothing is mocked: real processes and signals, the supervisor of ``openrl serve`` restarting
them, the unmodified ``tinker`` SDK retrying. Checked (``tests/chaos.py`` holds the loop and
the client's recovery policy): every future answered (a result, or a failed future of
category "server" that the client recovers from its last ``save_state``), no step lost or
applied twice (each run's adapter equals a fault-free twin's within 1e-6), every saved
checkpoint matches its manifest's sha256. The counts are printed (``-s``) and asserted
to be non-trivial. The long version is ``bench/chaos_soak.py``.
"""

from __future__ import annotations

import pytest

from chaos import FAULTS, SOAK_ENV, soak, summary
from conftest import _make_stack

pytest.importorskip("tinker")


@pytest.mark.parametrize("binding", ["pull", "push"])
def test_chaos_soak(binding, tmp_path_factory, models_dir):
    stack = _make_stack(tmp_path_factory, models_dir, supervise=True, push=binding == "push",
                        extra_env=dict(SOAK_ENV)).start()
    try:
        import random

        plan = list(FAULTS)
        random.Random(17).shuffle(plan)
        counts = soak(stack, seed=17, runs=4, min_steps=3, save_every=2, plan=plan, gap_s=(0.5, 3.0))
    finally:
        stack.stop()
    print(summary(counts, binding))
    assert dict(counts.faults) == {k: 1 for k in FAULTS}  # every kind hit once
    assert all(n >= 3 for n in counts.steps.values()), counts.steps
    assert counts.checkpoints_verified >= 4 * 2  # each run saved state + sampler weights at least once
    assert counts.requests > 4 * 3 * 2
