"""Sampler saves beside packed passes (``OPENRL_PACK_BESIDE_PASS=1``, functions/trainer/pass_window.py):
the real SDK against an embedded stack of its own. Four runs train concurrently, each saving an
unnamed snapshot after every optimizer step while the others' forward_backward passes hold the
engine lock; every snapshot must hold the weights of its run's last step, whichever way its pack
went (beside a pass, or under the lock): its logprobs equal those of a named snapshot saved right
after it, through the storage path, with nothing in between. Whether a given pack rode a pass
depends on timing; what each snapshot holds does not."""

from __future__ import annotations

import json
import threading

import pytest
from tinker import types

from conftest import BASE_MODEL
from test_snapshot_handoff_sdk import _counter, _datum

RUNS, STEPS = 4, 3


@pytest.fixture(scope="module")
def beside_stack(tmp_path_factory, models_dir):
    from conftest import _make_stack

    s = _make_stack(tmp_path_factory, models_dir, extra_env={"OPENRL_PACK_BESIDE_PASS": "1"}).start()
    yield s
    s.stop()


def test_snapshots_saved_beside_passes_hold_their_runs_last_step(beside_stack, api_key):
    import tinker

    service = tinker.ServiceClient(base_url=beside_stack.base_url, api_key=api_key)
    ports = json.loads((beside_stack.state_dir / "ports.json").read_text())["metrics"]
    prompt = types.ModelInput.from_ints(list(range(70, 86)))
    errors: list[BaseException] = []
    checked: list[int] = []

    def loop(i: int) -> None:
        try:
            tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4 + 4 * (i % 2), seed=30 + i).result()
            for step in range(STEPS):
                data = [_datum(list(range(10 + i + step, 50 + 7 * i)))] * (1 + i % 3)
                tc.forward_backward(data, "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
                eph = tc.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result()
                named = tc.save_weights_for_sampler(f"ref-{i}-{step}").result().path
                ref = service.create_sampling_client(model_path=named).result().compute_logprobs(prompt).result()
                assert eph[1:] == ref[1:], f"run {i} step {step}: the unnamed snapshot is not the step's weights"
                checked.append(i)
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(RUNS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert len(checked) == RUNS * STEPS
    packs = sum(_counter(ports["trainer"], "openrl_trainer_snapshot_packs_total", f'when="{w}"')
                for w in ("beside_pass", "locked"))
    assert packs == RUNS * STEPS  # every unnamed save packed once, one way or the other
