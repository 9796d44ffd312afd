"""The event contract (openrl/contract/): every op has a payload (or is protobuf), payloads
round-trip exactly what producers set, the topology routes every op to one function and
consumer, and the KV records keep unknown keys."""

from __future__ import annotations

import pytest

from openrl.contract import events, payloads, records, topology
from openrl.contract.ops import SAMPLE_OPS, SEQUENCED_OPS, TRAIN_OPS, Op
from openrl.errors import UserError


def test_every_op_has_one_payload_model_or_is_protobuf():
    for op in Op:
        assert (op in payloads.PAYLOADS) != (op in payloads.PROTOBUF_OPS), op
    assert set(TRAIN_OPS) | set(SAMPLE_OPS) == set(Op)
    assert not set(TRAIN_OPS) & set(SAMPLE_OPS)
    assert set(SEQUENCED_OPS) == set(TRAIN_OPS) - {Op.CREATE_MODEL, Op.UNLOAD_MODEL, Op.SKIP}


def test_op_is_its_string():
    assert Op.SAMPLE == "sample" and f"{Op.FORWARD}" == "forward"
    assert events.event_type(Op.OPTIM_STEP) == "dev.openrl.optim_step.v1"
    ev = events.request_event(Op.SKIP, "m:1:skip", "m", {"model_id": "m", "seq_id": 1})
    assert events.op_of(ev) is Op.SKIP


def test_payloads_carry_what_the_producer_set():
    assert payloads.Skip(model_id="m1", seq_id=3).to_data() == {"model_id": "m1", "seq_id": 3}
    assert payloads.UnloadModel(model_id="m", seq_id=None).to_data() == {"model_id": "m", "seq_id": None}
    save = payloads.SaveWeights(model_id="m", seq_id=2, path="tinker://m/weights/a", ttl_seconds=None, owner="o")
    assert save.to_data() == {"model_id": "m", "seq_id": 2, "path": "tinker://m/weights/a", "ttl_seconds": None,
                              "owner": "o"}
    create = payloads.CreateModel(model_id="m", base_model="b", lora_config={"rank": 4}, optimizer_config=None)
    assert create.to_data()["lora_config"] == {"rank": 4}
    back = payloads.parse_payload("create_model", create.to_data())
    assert back.lora_config.rank == 4 and back.lora_config.train_mlp is True


def test_handlers_get_defaults_and_user_errors():
    s = payloads.Sample.parse({"prompt_tokens": [1, 2], "base_model": "b", "type": "ignored"})
    assert (s.num_samples, s.sampling_params.temperature, s.sampling_params.top_k, s.model_path) == (1, 1.0, -1, None)
    with pytest.raises(UserError) as e:
        payloads.OptimStep.parse({"adam_params": {}})
    assert e.value.field == "data.seq_id"
    with pytest.raises(UserError):
        payloads.parse_payload("forward_backward", {})  # protobuf: no JSON payload


def test_topology_routes_every_op_to_one_function():
    for op in TRAIN_OPS:
        assert topology.function_of_op(op) == topology.TRAINER
        assert topology.subject_for(op, 3) == f"openrl.train.3.{op}"
        assert topology.stream_for(op) == topology.TRAIN_STREAM
    assert topology.subject_for(Op.SAMPLE, 3) == "openrl.sample.sample"
    assert topology.stream_for(Op.SAMPLE) == topology.SAMPLE_STREAM
    c = topology.consumer(topology.function_of_module("functions.trainer"), 2)
    assert c.as_dict() == {"stream": "OPENRL_TRAIN", "durable": "trainer-2", "filter_subject": "openrl.train.2.>",
                           "source": "/openrl/trainer"}
    assert topology.consumer("sampler").source == topology.source_of("sampler") == "/openrl/sampler"
    with pytest.raises(ValueError):
        topology.function_of_module("functions.gateway")
    with pytest.raises(ValueError):
        topology.function_of_op("unknown")


def test_records_keep_unknown_keys_and_future_records_round_trip():
    run = records.TrainingRun.model_validate({"model_id": "s:train:0", "session_id": "s", "owner": "o",
                                              "base_model": "b", "created": "t", "newer_field": 1})
    assert run.to_record()["newer_field"] == 1 and run.frozen is False
    rec = records.FutureRecord("ok", "sample", body=b"\x00\n\x01", meta={"owner": "o"})
    assert records.FutureRecord.decode(rec.encode()) == rec


def test_now_iso_reads_the_clock_once(monkeypatch):
    """openrl.transport.bus.now_iso: seconds and milliseconds of one clock reading (two readings
    put a time near a second's end up to 1 s early, and training runs listed newest first came
    out of order in CI)."""
    from openrl.transport import bus

    monkeypatch.setattr(bus.time, "time", lambda: 1796522641.9996)
    assert bus.now_iso() == "2026-12-06T02:04:01.999Z"
    monkeypatch.setattr(bus.time, "time", lambda: 1796522642.0004)
    assert bus.now_iso() == "2026-12-06T02:04:02.000Z"
