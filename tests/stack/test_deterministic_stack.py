"""The deterministic mode through the real SDK (issue 33): a stack started with
``Stack(deterministic=True)`` (what ``openrl serve --deterministic`` builds; ``OPENRL_DETERMINISTIC=1``
in the workers' environment). Two runs trained concurrently give the same ``loss:sum`` and
logprobs, step by step, as the same run trained alone: bitwise (CPU, float32), whether or not
the trainer packed their requests into one pass; the logprobs the sampler reports equal the
trainer's forward logprobs of the same tokens (``kl_sample_train`` exactly 0); a seeded request
gives the same tokens and logprobs alone and among 127 others; ``/api/v1/status`` shows the mode.

Against an external stack (the GPU conformance run, ``OPENRL_TEST_STACK_STATE``) the same test
runs when that serve's trainer reports the mode (``openrl serve --deterministic`` or
``OPENRL_DETERMINISTIC=1``: ``bash bench/device_call.sh determinism``), and skips otherwise.
"""

from __future__ import annotations

import time

import pytest
import tinker
from tinker import types

import httpx

from conftest import BASE_MODEL, EXTERNAL, _make_stack
from external_stack import ExternalStack, skip_reason

A = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13]
B = [(37 * i) % 5000 + 200 for i in range(29)]
C = [(11 * i) % 3000 + 50 for i in range(7)]
STEPS = 3


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def trainer_modes(stack, api_key: str) -> list[str | None]:
    """What ``/api/v1/status`` says of each trainer worker's mode: ``details.deterministic``
    ("on", "mixed", or None when the mode is off)."""
    st = httpx.get(f"{stack.base_url}/api/v1/status", headers={"X-API-Key": api_key}, timeout=10).json()
    return [(w.get("details") or {}).get("deterministic") for w in st["workers"] if w["function"] == "trainer"]


@pytest.fixture(scope="module")
def det_stack(tmp_path_factory, models_dir):
    if EXTERNAL is not None:
        s = ExternalStack.from_state(EXTERNAL)
        if "on" not in trainer_modes(s, s.api_key):
            pytest.skip(skip_reason("its trainer does not run the deterministic mode (openrl serve --deterministic)"))
        yield s
        return
    s = _make_stack(tmp_path_factory, models_dir, deterministic=True).start()
    yield s
    s.stop()



def _train(clients_and_data, steps: int = STEPS):
    """``steps`` x (every client's forward_backward submitted before any result is awaited, then
    every optim_step): per client, its [(loss:sum, logprobs of each datum)] per step."""
    seen = [[] for _ in clients_and_data]
    for _ in range(steps):
        futs = [tc.forward_backward(data, "cross_entropy") for tc, data in clients_and_data]
        outs = [f.result() for f in futs]
        steps_f = [tc.optim_step(types.AdamParams(learning_rate=1e-2)) for tc, _ in clients_and_data]
        for f in steps_f:
            f.result()
        for k, out in enumerate(outs):
            seen[k].append((out.metrics["loss:sum"], [o["logprobs"].tolist() for o in out.loss_fn_outputs]))
    return seen


def test_concurrent_runs_equal_the_run_alone(det_stack, api_key):
    svc = tinker.ServiceClient(base_url=det_stack.base_url, api_key=api_key)
    data = [_datum(A), _datum(C)]
    alone = svc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=41).result()
    (solo,) = _train([(alone, data)])
    twin = svc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=41).result()
    other = svc.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=42).result()
    packed, _ = _train([(twin, data), (other, [_datum(B), _datum(C), _datum(A)])])
    assert packed == solo
    assert solo[0][0] != solo[-1][0]  # training moved the loss


def test_status_shows_the_mode(det_stack, api_key):
    """After the training above the trainer has pulled and written its worker record; its record
    refreshes while it runs, so this waits (up to 60 s) for one that lists the trainer."""
    deadline = time.monotonic() + 60
    while not (modes := trainer_modes(det_stack, api_key)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert modes and set(modes) == {"on"}


def test_sampler_logprobs_equal_the_trainers(det_stack, api_key):
    """Issue 33 item 2: in the mode the logprob the sampler reports for each sampled token equals,
    bit for bit, the trainer's forward logprob of that token in the datum an RL loop builds from
    the sample (``prompt + tokens``), for an adapter that training moved, over several seeded
    samples of other lengths; ``kl_sample_train`` is then exactly 0."""
    svc = tinker.ServiceClient(base_url=det_stack.base_url, api_key=api_key)
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=43).result()
    _train([(tc, [_datum(A), _datum(B)])], steps=2)
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = A[:7]
    res = sc.sample(types.ModelInput.from_ints(prompt), num_samples=3,
                    sampling_params=types.SamplingParams(max_tokens=9, temperature=1.0, seed=5)).result()
    seqs = [s for s in res.sequences if s.tokens]
    assert seqs and all(s.logprobs is not None and len(s.logprobs) == len(s.tokens) for s in seqs)
    data = [_datum(prompt + list(s.tokens)) for s in seqs]
    out = tc.forward(data, "cross_entropy").result()
    for s, o in zip(seqs, out.loss_fn_outputs):
        trainer = o["logprobs"].tolist()[len(prompt) - 1:]
        assert list(s.logprobs) == trainer
    # the cookbook's RL datum (q = 0 and advantage 0 on the prompt): the trainer's mismatch metrics
    pad = [0.0] * (len(prompt) - 1)
    rl = [types.Datum(model_input=d.model_input,
                      loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                      "logprobs": pad + list(s.logprobs),
                                      "advantages": pad + [1.0] * len(s.tokens)}) for d, s in zip(data, seqs)]
    m = tc.forward(rl, "importance_sampling").result().metrics
    assert m["sample_train_tokens:sum"] == sum(len(s.tokens) for s in seqs)
    assert m["kl_sample_train_v1:mean"] == 0.0 and m["sample_train_logprob_diff_abs:max"] == 0.0


def test_seeded_sample_alone_equals_among_127_others(det_stack, api_key):
    """Issue 33 item 4: a seeded request's tokens and logprobs through the SDK are the same sent
    alone and sent among 127 other concurrent requests (the base model and an adapter, other
    prompts, lengths, temperatures and seeds), bit for bit."""
    svc = tinker.ServiceClient(base_url=det_stack.base_url, api_key=api_key)
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=44).result()
    _train([(tc, [_datum(C)])], steps=1)
    tuned = tc.save_weights_and_get_sampling_client().result()
    base = svc.create_sampling_client(base_model=BASE_MODEL).result()
    prompt = types.ModelInput.from_ints(B[:11])
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=9)

    def seqs(res):
        return [(list(s.tokens), list(s.logprobs)) for s in res.sequences]

    alone = seqs(tuned.sample(prompt, num_samples=2, sampling_params=params).result())
    others = []
    for i in range(127):
        client = base if i % 2 else tuned
        p = types.ModelInput.from_ints([(97 * i + 13 * t) % 5000 + 100 for t in range(3 + i % 23)])
        sp = types.SamplingParams(max_tokens=2 + i % 9, temperature=0.5 + (i % 4) * 0.25, seed=1000 + i)
        others.append(client.sample(p, num_samples=1, sampling_params=sp))
        if i == 63:
            target = tuned.sample(prompt, num_samples=2, sampling_params=params)
    among = seqs(target.result())
    assert all(len(f.result().sequences) == 1 for f in others)
    assert among == alone
    assert alone[0] != alone[1]  # the two samples drew differently
