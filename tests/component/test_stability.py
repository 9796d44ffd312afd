"""The stability store (openrl/transport/stability.py) on a real nats-server, and the trainer's
resolution of provenance spans against it (functions/trainer/stability.py): recorded logprobs
land on the span-named sampled targets; unknown, expired and other-session sequence ids, spans
outside the record and tokens that differ fail with a UserError naming the field; a training
use restarts the day. Time is an injected clock (no waiting a day); nothing else is mocked."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from functions.trainer import stability
from functions.trainer.losses import RECORDED_LOGPROBS, SAMPLED_MASK
from openrl.contract.stability import TTL_S, SequenceRecord, sequence_ids
from openrl.edge.proto import FwdBwdDatum, FwdBwdRequest, Span
from openrl.errors import UserError
from openrl.transport.local_servers import PortHold, start_nats
from openrl.transport.stability import StabilityStore

SESSION = "sess-a"
RUN = f"{SESSION}:train:0"
SAMPLER = f"{SESSION}:sample:0"
PROMPT = [5, 6, 7]
SAMPLED = [11, 12, 13, 14]
LOGPROBS = [-0.5, -1.25, -0.125, -2.0]


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


@pytest.fixture()
def store(tmp_path):
    with PortHold() as hold:  # a free port, held until the server is gone
        proc = start_nats(tmp_path, hold.port)
        clock = Clock()
        s = StabilityStore(f"nats://127.0.0.1:{hold.port}", clock=clock)
        s.test_clock = clock
        yield s
        proc.terminate()
        proc.wait(timeout=30)


def _record(session=SESSION, owner="o1", t=1_000_000.0) -> SequenceRecord:
    return SequenceRecord(owner=owner, session_id=session, sampler_id=SAMPLER, prompt_len=len(PROMPT),
                          tokens=np.array(SAMPLED), logprobs=np.array(LOGPROBS, np.float32), used_at=t)


def _request(sid: str, *, targets=None, prompt_span=None, sampled_len=4) -> FwdBwdRequest:
    """rl_loop's datum: prompt + sampled[:-1] as input, targets shifted by one (prompt targets 0)."""
    tokens = PROMPT + SAMPLED[:-1]
    tt = np.array(targets if targets is not None else [0, 0] + SAMPLED, np.int64)
    adv = np.array([0, 0, 1, 1, 1, 1], np.float32)
    d = FwdBwdDatum(tokens=tokens, loss_fn_inputs={"target_tokens": tt, "advantages": adv},
                    model_input_spans=[Span("prompt", sid, 0, 3), Span("sampled", sid, 0, 3)],
                    loss_fn_input_spans=[prompt_span or Span("prompt", sid, 1, 2), Span("sampled", sid, 0, sampled_len)])
    return FwdBwdRequest(model_id=RUN, seq_id=1, loss_fn="stable_reinforce", loss_fn_config={}, forward_only=False,
                         data=[d])


async def _resolve(store, fb, owner="o1"):
    await stability.resolve_request(store, fb, model_id=RUN, owner=owner)
    return fb.data[0].loss_fn_inputs


async def _fails(store, fb, field, text, owner="o1"):
    with pytest.raises(UserError) as e:
        await _resolve(store, fb, owner)
    assert e.value.field == field and text in str(e.value), (e.value.field, str(e.value))


def test_resolution_and_every_refusal(store):
    async def main():
        ids = sequence_ids(f"{SAMPLER}:1", 2)
        other = f"sess-b:sample:0:1:0"
        await store.put_many({ids[0]: _record(), ids[1]: _record(), other: _record(session="sess-b")})

        got = await _resolve(store, _request(ids[0]))
        np.testing.assert_array_equal(got[SAMPLED_MASK], [0, 0, 1, 1, 1, 1])
        np.testing.assert_array_equal(got[RECORDED_LOGPROBS], np.float32([0, 0, *LOGPROBS]))

        await _fails(store, _request("nope:sample:0:1:0"), "data[0].model_input_spans[0].sequence_id",
                     "unknown sequence_id")
        await _fails(store, _request(other), "data[0].model_input_spans[0].sequence_id", "another session")
        await _fails(store, _request(ids[1]), "data[0].model_input_spans[0].sequence_id", "another session",
                     owner="o2")
        await _fails(store, _request(ids[1], targets=[0, 0, 11, 12, 99, 14]), "data[0].loss_fn_input_spans[1]",
                     "not the sampled tokens")
        await _fails(store, _request(ids[1], prompt_span=Span("prompt", ids[1], 2, 2)),
                     "data[0].loss_fn_input_spans[0]", "outside the 3-token prompt")
        bad = _request(ids[1])
        bad.data[0].loss_fn_input_spans[1] = Span("sampled", ids[1], 1, 4)
        await _fails(store, bad, "data[0].loss_fn_input_spans[1]", "outside the 4 sampled tokens")
        sent = _request(ids[1])
        sent.data[0].loss_fn_inputs[RECORDED_LOGPROBS] = np.zeros(6, np.float32)
        await _fails(store, sent, f"data[0].loss_fn_inputs.{RECORDED_LOGPROBS}", "set by the server")

        # the day: ids[0] was used at t0; just under a day later it still resolves (and is touched)
        store.test_clock.t += TTL_S - 1
        await _resolve(store, _request(ids[0]))
        assert (await store.get(ids[0])).used_at == store.test_clock.t
        # ids[1] was never trained on: now past its day, it is expired (and then gone)
        store.test_clock.t += 2
        await _fails(store, _request(ids[1]), "data[0].model_input_spans[0].sequence_id", "expired")
        assert await store.get(ids[1]) is None
        # ids[0] is 2 s into its restarted day: still fine; a day later it expires too
        await _resolve(store, _request(ids[0]))
        store.test_clock.t += TTL_S + 1
        await _fails(store, _request(ids[0]), "data[0].model_input_spans[0].sequence_id", "expired")
        await store.close()

    asyncio.run(main())


def test_records_round_trip_bytes():
    rec = _record()
    back = SequenceRecord.from_bytes(rec.to_bytes())
    assert (back.owner, back.session_id, back.prompt_len, back.used_at) == ("o1", SESSION, 3, rec.used_at)
    np.testing.assert_array_equal(back.tokens, SAMPLED)
    np.testing.assert_array_equal(back.logprobs, np.float32(LOGPROBS))
    with pytest.raises(ValueError):
        SequenceRecord.from_bytes(b'{"format":"x"}\n')
