"""openrl.edge.proto against the real tinker 0.38.0 SDK encoder / decoder."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import zstandard
from google.protobuf import descriptor_pb2

import openrl.edge.proto as P
from openrl.errors import UserError

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results  # noqa: E402
from tinker.proto import request_conv, response_conv  # noqa: E402
from tinker.proto import tinker_public_pb2 as sdk_pb  # noqa: E402


# ---------------------------------------------------------------------------- descriptor


def _sdk_file() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto()
    sdk_pb.DESCRIPTOR.CopyToProto(fdp)
    return fdp


def _summary(fdp: descriptor_pb2.FileDescriptorProto) -> dict:
    def msg(m, prefix):
        out = {}
        name = f"{prefix}.{m.name}"
        out[name] = {
            f.name: (
                f.number, f.type, f.label, f.type_name, f.proto3_optional,
                m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None,
            )
            for f in m.field
        }
        out[name + "#map_entry"] = m.options.map_entry
        for n in m.nested_type:
            out.update(msg(n, name))
        return out

    s = {}
    for m in fdp.message_type:
        s.update(msg(m, fdp.package))
    for e in fdp.enum_type:
        s[f"enum {e.name}"] = [(v.name, v.number) for v in e.value]
    s["syntax"] = fdp.syntax
    return s


def test_descriptor_matches_sdk():
    ours, sdk = _summary(P.FILE_DESCRIPTOR_PROTO), _summary(_sdk_file())
    assert set(ours) == set(sdk)
    for k in sdk:
        assert ours[k] == sdk[k], k
    # Stronger: byte-identical FileDescriptorProto (same order too).
    assert P.FILE_DESCRIPTOR_PROTO == _sdk_file()


def test_enums_match_sdk():
    assert [(d.name, d.value) for d in P.DType] == [
        (n.removeprefix("DTYPE_"), v) for n, v in sdk_pb.DType.items()
    ]
    assert [(d.name, d.value) for d in P.StopReason] == [
        (n.removeprefix("STOP_REASON_"), v) for n, v in sdk_pb.StopReason.items()
    ]


def test_server_modules_do_not_import_tinker():
    code = "import sys, openrl.edge.proto, openrl.edge.wire; assert not any(m == 'tinker' or m.startswith('tinker.') for m in sys.modules), 'tinker imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- requests


def _sdk_body(data, loss_fn="cross_entropy", loss_fn_config=None, *, model_id="s1:train:0",
              seq_id=1, forward_only=False) -> bytes:
    req = T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config),
        model_id=model_id,
        seq_id=seq_id,
    )
    msg = request_conv.forward_backward_request_to_proto(req)
    msg.forward_only = forward_only  # as resources/training.py does
    return msg.SerializeToString()


def _sdk_datums():
    rng = np.random.default_rng(0)
    d0 = T.Datum(  # numpy arrays
        model_input=T.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={
            "target_tokens": np.array([2, 3, 4, 5], dtype=np.int64),
            "weights": np.array([0, 1, 1, 0.5], dtype=np.float32),
        },
    )
    d1 = T.Datum(  # plain lists, several chunks, RL inputs
        model_input=T.ModelInput(chunks=[T.EncodedTextChunk(tokens=[7, 8]), T.EncodedTextChunk(tokens=[9])]),
        loss_fn_inputs={
            "target_tokens": [8, 9, 10],
            "logprobs": [-0.5, -1.25, -2.0],
            "advantages": [1.0, 1.0, -1.0],
        },
    )
    t, k = 6, 5
    tt = torch.zeros(t, k, dtype=torch.int64)
    ww = torch.zeros(t, k, dtype=torch.float32)
    for i in range(t):
        tt[i, 0] = 100 + i
        ww[i, 0] = 1.0
    tt[2, 3], ww[2, 3] = 555, 0.25
    d2 = T.Datum(  # 2-D torch tensors: the SDK sends these as CSR
        model_input=T.ModelInput.from_ints(list(range(10, 10 + t))),
        loss_fn_inputs={"target_tokens": tt, "weights": ww},
    )
    d3 = T.Datum(  # dense 1-D torch tensors, large vocab ids
        model_input=T.ModelInput.from_ints([151643, 0, 151000]),
        loss_fn_inputs={
            "target_tokens": torch.tensor([0, 151000, 151643]),
            "weights": torch.tensor(rng.random(3), dtype=torch.float32),
        },
    )
    return [d0, d1, d2, d3]


def _assert_same(decoded: P.FwdBwdRequest, datums):
    assert len(decoded.data) == len(datums)
    for ours, sdk in zip(decoded.data, datums):
        assert ours.tokens == sdk.model_input.to_ints()
        assert set(ours.loss_fn_inputs) == set(sdk.loss_fn_inputs)
        for key, td in sdk.loss_fn_inputs.items():
            expect = td.to_numpy()
            got = ours.loss_fn_inputs[key]
            assert got.dtype == expect.dtype, key
            assert got.shape == expect.shape, key
            np.testing.assert_array_equal(got, expect)
            assert got.flags.writeable


def test_decode_sdk_request():
    datums = _sdk_datums()
    assert datums[2].loss_fn_inputs["target_tokens"].sparse_crow_indices is not None  # really CSR
    cfg = {"clip_low_threshold": 0.8, "kl_coeff": 2, "loss_id": "abc"}
    body = _sdk_body(datums, "ppo", cfg, seq_id=7)
    req = P.decode_forward_backward_request(body)
    assert req.model_id == "s1:train:0"
    assert req.seq_id == 7
    assert req.loss_fn == "ppo"
    assert req.forward_only is False
    assert req.loss_fn_config == {"clip_low_threshold": 0.8, "kl_coeff": 2.0, "loss_id": "abc"}
    _assert_same(req, datums)
    assert req.data[0].loss_fn_inputs["target_tokens"].dtype == np.int64
    assert req.data[0].loss_fn_inputs["weights"].dtype == np.float32
    assert req.data[2].loss_fn_inputs["target_tokens"].shape == (6, 5)


def test_peek_run_and_seq_reads_the_head_of_sdk_bodies():
    """The SDK's encoder writes model_id and seq_id before the datums, so the first
    HEAD_BYTES of a body of any size (plain or zstd) name the run and seq_id; a truncated
    or foreign head gives None for what it lacks and never raises."""
    big = T.Datum(model_input=T.ModelInput.from_ints([1] * 200_000),
                  loss_fn_inputs={"target_tokens": np.ones(200_000, np.int64),
                                  "weights": np.ones(200_000, np.float32)})
    body = _sdk_body([big], seq_id=300)
    assert len(body) > 100 * P.HEAD_BYTES
    assert P.peek_run_and_seq(body[:P.HEAD_BYTES]) == ("s1:train:0", 300)
    packed = zstandard.ZstdCompressor().compress(body)
    assert P.peek_run_and_seq(packed[:P.HEAD_BYTES], "zstd") == ("s1:train:0", 300)
    assert P.peek_run_and_seq(body[:5]) == (None, None)  # model_id cut off
    assert P.peek_run_and_seq(body[:12]) == ("s1:train:0", None)  # seq_id not reached
    for junk in (b"", b"\xff" * 20, b"\x0a\xff\xff\xff\xff\x0f", b"not protobuf at all"):
        P.peek_run_and_seq(junk)
        P.peek_run_and_seq(junk, "zstd")


def test_decode_zstd_and_forward_only():
    datums = _sdk_datums()[:2]
    body = zstandard.ZstdCompressor().compress(_sdk_body(datums, forward_only=True))
    req = P.decode_forward_backward_request(body, content_encoding="zstd")
    assert req.forward_only is True
    assert req.loss_fn_config == {}
    _assert_same(req, datums)
    # streamed frames carry no content size
    cobj = zstandard.ZstdCompressor().compressobj()
    streamed = cobj.compress(_sdk_body(datums)) + cobj.flush()
    _assert_same(P.decode_forward_backward_request(streamed, content_encoding="ZSTD"), datums)


def test_legacy_only_and_v2_wins():
    msg = sdk_pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    msg.loss_fn_config["a"] = 1.0
    msg.loss_fn_config["b"] = 2.0
    msg.loss_fn_config_v2["b"].number = 3.0
    msg.loss_fn_config_v2["c"].text = "x"
    req = P.decode_forward_backward_request(msg.SerializeToString())
    assert req.loss_fn_config == {"a": 1.0, "b": 3.0, "c": "x"}
    assert req.data == []


def test_our_encoder_round_trip():
    data = [
        P.FwdBwdDatum([1, 2, 3], {"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, np.float32)}),
        P.FwdBwdDatum([5], {"target_tokens": np.array([6]), "weights": np.zeros(1, np.float32),
                            "extra": np.arange(6, dtype=np.float32).reshape(1, 2, 3)}),
    ]
    body = P.encode_forward_backward_request("m:train:0", 3, data, "cross_entropy", {"x": 1.5, "s": "t"}, True)
    # the SDK's generated classes read our bytes
    sdk_msg = sdk_pb.ForwardBackwardRequest.FromString(body)
    assert sdk_msg.seq_id == 3 and sdk_msg.forward_only and sdk_msg.loss_fn_config_v2["s"].text == "t"
    req = P.decode_forward_backward_request(body)
    assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == ("m:train:0", 3, "cross_entropy", True)
    assert req.loss_fn_config == {"x": 1.5, "s": "t"}
    for a, b in zip(req.data, data):
        assert a.tokens == b.tokens
        for k in b.loss_fn_inputs:
            np.testing.assert_array_equal(a.loss_fn_inputs[k], b.loss_fn_inputs[k])
    assert req.data[1].loss_fn_inputs["extra"].shape == (1, 2, 3)


# ------------------------------------------------------------------------- request errors


def _one_datum_msg(**kw):
    d = T.Datum(
        model_input=T.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, np.float32)},
        **kw,
    )
    return sdk_pb.ForwardBackwardRequest.FromString(_sdk_body([d, d]))


def _field_of(body, **kw) -> str:
    with pytest.raises(UserError) as ei:
        P.decode_forward_backward_request(body, **kw)
    assert ei.value.category == "user"
    return ei.value.field


def test_image_chunk_rejected():
    d = T.Datum(
        model_input=T.ModelInput(chunks=[
            T.EncodedTextChunk(tokens=[1, 2]),
            T.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4),
        ]),
        loss_fn_inputs={"target_tokens": np.array([2, 3, 4, 5, 6, 7])},
    )
    with pytest.raises(UserError) as ei:
        P.decode_forward_backward_request(_sdk_body([_sdk_datums()[0], d]))
    assert ei.value.field == "data[1].model_input.chunks[1]"
    assert "image chunks are not supported by this server" in str(ei.value)


def test_malformed_bodies():
    assert _field_of(b"\xff\xff\xff\xff") == "body"
    assert _field_of(b"not zstd", content_encoding="zstd") == "body"
    assert _field_of(b"", content_encoding="gzip") == "Content-Encoding"
    assert _field_of(b"") == "model_id"
    msg = _one_datum_msg()
    msg.seq_id = 0
    assert _field_of(msg.SerializeToString()) == "seq_id"
    msg = _one_datum_msg()
    msg.loss_fn = ""
    assert _field_of(msg.SerializeToString()) == "loss_fn"


def test_tensor_errors():
    def mutate(fn):
        msg = _one_datum_msg()
        fn(msg.data[1])
        return _field_of(msg.SerializeToString())

    w = "data[1].loss_fn_inputs.weights"
    tt = "data[1].loss_fn_inputs.target_tokens"
    assert mutate(lambda d: setattr(d.loss_fn_inputs["weights"], "dtype", 0)) == w
    assert mutate(lambda d: setattr(d.loss_fn_inputs["weights"], "dtype", 99)) == w
    assert mutate(lambda d: setattr(d.loss_fn_inputs["weights"], "dense", b"\0" * 8)) == w  # 2 != 3
    assert mutate(lambda d: setattr(d.loss_fn_inputs["weights"], "dense", b"\0" * 13)) == w  # not /4
    assert mutate(lambda d: d.loss_fn_inputs["weights"].shape.append(2)) == w  # [3,2] needs 6
    assert mutate(lambda d: setattr(d.loss_fn_inputs["target_tokens"], "dtype", 1)) == tt  # float ids

    def too_short(d):  # consistent tensor, but 2 entries for 3 tokens
        t = d.loss_fn_inputs["weights"]
        t.dense = np.ones(2, "<f4").tobytes()
        del t.shape[:]
        t.shape.append(2)
    assert mutate(too_short) == w

    def bad_csr(d):
        t = d.loss_fn_inputs["weights"]
        del t.shape[:]
        t.shape.extend([3, 2])
        t.sparse_csr.values = np.ones(2, "<f4").tobytes()
        t.sparse_csr.crow_indices = np.array([0, 1, 5, 2], "<i8").tobytes()
        t.sparse_csr.col_indices = np.array([0, 1], "<i8").tobytes()
    assert mutate(bad_csr) == w

    def bad_tokens(d):
        d.model_input[0].encoded_text.tokens = b"\x01\x02\x03"
    assert mutate(bad_tokens) == "data[1].model_input.chunks[0]"

    def neg_tokens(d):
        d.model_input[0].encoded_text.tokens = np.array([-1, 2, 3], "<i4").tobytes()
    assert mutate(neg_tokens) == "data[1].model_input.chunks[0]"


def test_int_weights_become_float32_and_missing_shape_is_1d():
    msg = sdk_pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1, 2], "<i4").tobytes()
    d.loss_fn_inputs["weights"].dense = np.array([1, 0], "<i8").tobytes()
    d.loss_fn_inputs["weights"].dtype = sdk_pb.DTYPE_INT64
    d.loss_fn_inputs["mask"].dense = np.array([1, 0, 1], "<i8").tobytes()
    d.loss_fn_inputs["mask"].dtype = sdk_pb.DTYPE_INT64
    req = P.decode_forward_backward_request(msg.SerializeToString())
    w = req.data[0].loss_fn_inputs["weights"]
    assert w.dtype == np.float32 and w.tolist() == [1.0, 0.0]
    m = req.data[0].loss_fn_inputs["mask"]
    assert m.dtype == np.int64 and m.shape == (3,)


# ---------------------------------------------------------------------------- outputs


def test_forward_backward_output_sdk_decodes():
    rng = np.random.default_rng(1)
    outs = [
        {"logprobs": rng.normal(size=n).astype(np.float32), "elementwise_loss": rng.normal(size=n),
         "topk_ids": rng.integers(0, 1000, size=(n, 3))}
        for n in (4, 1, 7, 0)
    ]
    metrics = {"loss:sum": 12.5, "ntokens:sum": 12.0, "lr:mean": 1e-4}
    body = P.encode_forward_backward_output(outs, metrics)
    sdk = response_conv.deserialize_forward_backward_output(body)
    assert sdk.loss_fn_output_type == "TorchLossReturn"  # as the SDK's own tests model hosted Tinker's answer
    assert sdk.metrics == metrics
    assert len(sdk.loss_fn_outputs) == 4
    for ours, theirs in zip(outs, sdk.loss_fn_outputs):
        assert theirs["logprobs"].dtype == "float32"
        np.testing.assert_array_equal(theirs["logprobs"].to_numpy(), ours["logprobs"])
        np.testing.assert_allclose(theirs["elementwise_loss"].to_numpy(), ours["elementwise_loss"], rtol=1e-6)
        assert theirs["topk_ids"].dtype == "int64"
        assert theirs["topk_ids"].shape == list(ours["topk_ids"].shape)
        np.testing.assert_array_equal(theirs["topk_ids"].to_numpy(), ours["topk_ids"])
    # The SDK always merges chunk results; ours must survive that.
    combined = combine_fwd_bwd_output_results([sdk, sdk])
    assert combined.metrics["loss:sum"] == 25.0
    assert len(combined.loss_fn_outputs) == 8


def test_forward_backward_output_empty_and_errors():
    sdk = response_conv.deserialize_forward_backward_output(P.encode_forward_backward_output([], {"loss:sum": 0.0}))
    assert sdk.loss_fn_outputs == [] and sdk.metrics == {"loss:sum": 0.0}
    with pytest.raises(ValueError):
        P.encode_forward_backward_output([{"logprobs": np.zeros(2)}], {"loss": 1.0})
    with pytest.raises(ValueError):
        P.encode_forward_backward_output([{"logprobs": np.zeros(2)}, {"x": np.zeros(2)}], {})


def test_sample_response_sdk_decodes():
    seqs = [
        P.SampledSeq(tokens=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3], stop_reason="stop",
                     topk=(np.array([[5, 1], [6, 2], [7, 0]]), np.array([[-0.1, -3], [-0.2, -4], [-0.3, -99999.0]]))),
        P.SampledSeq(tokens=np.array([9, 9]), logprobs=None, stop_reason="length"),
        P.SampledSeq(tokens=[], logprobs=[], stop_reason="length"),
    ]
    prompt_lp = [math.nan, -1.5, -2.5, -0.25]
    topk_prompt = (np.array([[0, 0], [3, 4], [5, 6], [7, 8]]),
                   np.array([[-99999.0, -99999.0], [-1, -2], [-3, -4], [-5, -6]], np.float32))
    target = np.array([[-1.0, 0.0], [-2.0, -3.0], [0.0, -4.0]], np.float32)
    alt = (np.array([[1, 2], [3, 4], [5, 6]]), np.array([[-1, -2], [-3, -4], [-5, -6]], np.float32))
    body = P.encode_sample_response(seqs, prompt_lp, topk_prompt, prompt_cache_hit_tokens=3,
                                    target_prompt_logprobs=target, prompt_alt_tokens=alt)
    r = response_conv.deserialize_sample_response(body)
    assert [s.stop_reason for s in r.sequences] == ["stop", "length", "length"]
    assert r.sequences[0].tokens == [5, 6, 7]
    np.testing.assert_allclose(r.sequences[0].logprobs, [-0.1, -0.2, -0.3], rtol=1e-6)
    assert r.sequences[0].topk_logprobs[2] == [(7, pytest.approx(-0.3))]
    assert r.sequences[1].tokens == [9, 9] and r.sequences[1].logprobs is None
    assert r.sequences[2].tokens == []
    assert r.prompt_logprobs == [None, -1.5, -2.5, -0.25]
    assert r.topk_prompt_logprobs[0] is None
    assert r.topk_prompt_logprobs[1] == [(3, -1.0), (4, -2.0)]
    assert r.prompt_cache_hit_tokens == 3
    np.testing.assert_array_equal(r.target_prompt_logprobs.to_numpy(), target)
    np.testing.assert_array_equal(r.prompt_alt_tokens.tokens.to_numpy(), alt[0])
    np.testing.assert_array_equal(r.prompt_alt_tokens.logprobs.to_numpy(), alt[1])


def test_sample_response_minimal_and_csr_target():
    r = response_conv.deserialize_sample_response(P.encode_sample_response([P.SampledSeq([1], [-0.5])]))
    assert r.prompt_logprobs is None and r.topk_prompt_logprobs is None
    assert r.target_prompt_logprobs is None and r.prompt_alt_tokens is None
    assert r.sequences[0].stop_reason == "stop"

    # CSR target_prompt_logprobs: same layout as the request's
    req_ids = torch.full((6, 8), -1, dtype=torch.int64)
    req_ids[0, 0], req_ids[1, 3], req_ids[5, 7], req_ids[5, 0] = 5, 7, 0, 11
    td = T.TensorData.from_torch_sparse(req_ids, pad_value=-1)
    assert td.sparse_crow_indices is not None
    dense_lp = np.where(req_ids.numpy() >= 0, -1.0 * (req_ids.numpy() + 1), 0.0).astype(np.float32)
    body = P.encode_sample_response(
        [P.SampledSeq([1], [-0.5])],
        target_prompt_logprobs=dense_lp,
        target_prompt_logprobs_csr=(td.sparse_crow_indices, td.sparse_col_indices),
    )
    out = response_conv.deserialize_sample_response(body).target_prompt_logprobs
    assert out.sparse_crow_indices == td.sparse_crow_indices
    assert out.sparse_col_indices == td.sparse_col_indices
    np.testing.assert_array_equal(out.to_numpy(), dense_lp)

    with pytest.raises(ValueError):
        P.encode_sample_response([P.SampledSeq([1, 2], [-0.5])])
    with pytest.raises(ValueError):
        P.encode_sample_response([P.SampledSeq([1], stop_reason="eos")])  # type: ignore[arg-type]


def test_results_as_json_match_what_the_sdk_decodes():
    """retrieve_future's JSON form of a protobuf result (openrl.edge.proto.tojson) holds what the
    SDK's own decoder reads from the same bytes, with the SDK's field names."""
    from openrl.edge.proto.tojson import forward_backward_output_json, result_json, sample_response_json

    rng = np.random.default_rng(2)
    outs = [{"logprobs": rng.normal(size=n).astype(np.float32), "topk_ids": rng.integers(0, 99, size=(n, 3))}
            for n in (4, 1, 0)]
    outs.append({"logprobs": rng.normal(size=(2, 5)).astype(np.float32), "topk_ids": np.zeros((2, 3), np.int64)})
    body = P.encode_forward_backward_output(outs, {"loss:sum": 1.5})
    sdk = response_conv.deserialize_forward_backward_output(body)
    js = forward_backward_output_json(body)
    assert js == result_json("forward_backward", body, "r") and js["metrics"] == {"loss:sum": 1.5}
    assert js["loss_fn_output_type"] == sdk.loss_fn_output_type and len(js["loss_fn_outputs"]) == 4
    for mine, theirs in zip(js["loss_fn_outputs"], sdk.loss_fn_outputs):
        for key in ("logprobs", "topk_ids"):
            assert mine[key]["dtype"] == theirs[key].dtype and mine[key]["shape"] == list(theirs[key].shape)
            np.testing.assert_array_equal(np.asarray(mine[key]["data"]).reshape(mine[key]["shape"]),
                                          theirs[key].to_numpy())

    seqs = [P.SampledSeq([5, 6], [-0.1, -0.2], "stop", topk=(np.array([[5, 1], [6, 0]]),
                                                               np.array([[-0.1, -3], [-0.2, -99999.0]]))),
            P.SampledSeq([9], None, "length")]
    target = np.array([[-1.0, 0.0], [-2.0, -3.0]], np.float32)
    alt = (np.array([[1], [3]]), np.array([[-1], [-3]], np.float32))
    body = P.encode_sample_response(seqs, [math.nan, -1.5, -2.5], (np.array([[0], [3], [5]]),
                                                                  np.array([[-99999.0], [-1], [-3]], np.float32)),
                                    prompt_cache_hit_tokens=2, target_prompt_logprobs=target, prompt_alt_tokens=alt)
    sdk = response_conv.deserialize_sample_response(body)
    js = sample_response_json(body, "sess:sample:0:7")
    assert js == result_json("sample", body, "sess:sample:0:7")
    assert js["type"] == "sample" and js["prompt_cache_hit_tokens"] == 2
    assert [s["sequence_id"] for s in js["sequences"]] == ["sess:sample:0:7:0", "sess:sample:0:7:1"]
    for mine, theirs in zip(js["sequences"], sdk.sequences):
        assert mine["stop_reason"] == theirs.stop_reason and mine["tokens"] == theirs.tokens
        assert mine.get("logprobs") == (None if theirs.logprobs is None else pytest.approx(theirs.logprobs))
        want = theirs.topk_logprobs
        assert mine.get("topk_logprobs") == (None if want is None else [
            None if row is None else [[i, pytest.approx(lp)] for i, lp in row] for row in want])
    assert js["prompt_logprobs"] == [None, -1.5, -2.5] == sdk.prompt_logprobs
    assert js["topk_prompt_logprobs"] == [None, [[3, -1.0]], [[5, -3.0]]]
    assert js["target_prompt_logprobs"] == {"data": [-1.0, 0.0, -2.0, -3.0], "dtype": "float32", "shape": [2, 2]}
    assert js["prompt_alt_tokens"]["tokens"] == {"data": [1, 3], "dtype": "int64", "shape": [2, 1]}
    json_text = __import__("json").dumps(js, allow_nan=False)  # strict JSON: no NaN
    assert "NaN" not in json_text


def test_unknown_protobuf_fields_are_refused_naming_them():
    """Invariant 12 for protobuf bodies: a field number the schema lacks, at any depth."""
    good = P.encode_forward_backward_request("m", 1, [P.FwdBwdDatum([1, 2], {"weights": np.ones(2, np.float32)})],
                                             "cross_entropy")
    P.decode_forward_backward_request(good)
    with pytest.raises(UserError) as ei:  # top level: field 9, varint 5
        P.decode_forward_backward_request(good + bytes([(9 << 3) | 0, 5]))
    assert ei.value.field == "#9" and "ForwardBackwardRequest" in ei.value.message
    msg = P.ForwardBackwardRequest()
    msg.ParseFromString(good)
    # inside a chunk and inside a tensor: an unknown field appended to the nested message's bytes
    chunk = P.Chunk()
    chunk.ParseFromString(msg.data[0].model_input[0].SerializeToString() + bytes([(7 << 3) | 0, 1]))
    msg.data[0].model_input[0].CopyFrom(chunk)
    with pytest.raises(UserError) as ei:
        P.decode_forward_backward_request(msg.SerializeToString())
    assert ei.value.field == "data[0].model_input.chunks[0].#7"
    msg.ParseFromString(good)
    t = P.Tensor()
    t.ParseFromString(msg.data[0].loss_fn_inputs["weights"].SerializeToString() + bytes([(12 << 3) | 2, 1, 0]))
    msg.data[0].loss_fn_inputs["weights"].CopyFrom(t)
    with pytest.raises(UserError) as ei:
        P.decode_forward_backward_request(msg.SerializeToString())
    assert ei.value.field == "data[0].loss_fn_inputs.weights.#12"


def test_csr_to_dense_pad():
    out = P.csr_to_dense(np.array([4, 5]), [0, 1, 1, 2], [2, 0], [3, 3], pad_value=-1)
    assert out.tolist() == [[-1, -1, 4], [-1, -1, -1], [5, -1, -1]]
    with pytest.raises(UserError):
        P.csr_to_dense(np.array([1]), [0, 1], [0], [1 << 20, 1 << 20])
