"""openrl.edge.wire against request bodies built by the real tinker 0.38.0 SDK."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import numpy as np
import pydantic
import pytest
import torch

import openrl.edge.wire as W
from openrl.errors import UserError

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402
from tinker._compat import model_dump  # noqa: E402


def sdk_body(req) -> dict:
    """Exactly what the SDK's resources/*.py put on the wire, through JSON."""
    return json.loads(json.dumps(model_dump(req, exclude_unset=False, exclude_none=True, mode="json")))


def user_error(model, body) -> UserError:
    with pytest.raises(UserError) as ei:
        W.parse_request(model, body)
    assert ei.value.category == "user" and ei.value.status == 400
    return ei.value


# ---------------------------------------------------------------------- SDK bodies validate


def test_session_bodies():
    body = sdk_body(T.CreateSessionRequest(tags=["a", "b"], user_metadata={"k": 1}, sdk_version="0.38.0",
                                           display_name="run"))
    assert body["type"] == "create_session"
    r = W.parse_request(W.CreateSessionRequest, body)
    assert (r.tags, r.user_metadata, r.sdk_version, r.display_name) == (["a", "b"], {"k": 1}, "0.38.0", "run")
    assert W.parse_request(W.SessionHeartbeatRequest, sdk_body(T.SessionHeartbeatRequest(session_id="s1"))).session_id == "s1"
    assert W.parse_request(W.ClientConfigRequest, sdk_body(T.ClientConfigRequest(sdk_version="0.38.0"))).sdk_version == "0.38.0"
    fin = W.parse_request(W.SessionFinishRequest, {"reason": {"type": "errored"}, "detail": None})
    assert fin.reason.type == "errored" and fin.detail is None
    fut = W.parse_request(W.RetrieveFutureRequest, sdk_body(T.FutureRetrieveRequest(request_id="r1", allow_metadata_only=True)))
    assert fut.request_id == "r1" and fut.allow_metadata_only


def test_telemetry_body():
    ev = T.SessionStartEvent(event="SESSION_START", event_id="e", event_session_index=0, severity="INFO",
                             timestamp=datetime.now(timezone.utc))
    body = sdk_body(T.TelemetrySendRequest(events=[ev], platform="linux", sdk_version="0.38.0",
                                           session_id="s", process_uuid="p"))
    r = W.parse_request(W.TelemetryRequest, body)
    assert r.events[0]["event"] == "SESSION_START" and r.session_id == "s"


def test_create_model_bodies():
    body = sdk_body(T.CreateModelRequest(session_id="s", model_seq_id=0, base_model="Qwen/Qwen3-8B",
                                         lora_config=T.LoraConfig(rank=16, seed=3, train_unembed=False),
                                         user_metadata={"x": "y"}))
    assert body["optimizer_config"] == {"type": "adamw"}
    r = W.parse_request(W.CreateModelRequest, body)
    assert r.base_model == "Qwen/Qwen3-8B" and r.model_seq_id == 0
    assert (r.lora_config.rank, r.lora_config.seed, r.lora_config.train_unembed, r.lora_config.train_mlp) == (16, 3, False, True)
    assert isinstance(r.optimizer_config, W.AdamwConfig)
    body = sdk_body(T.CreateModelRequest(session_id="s", model_seq_id=1, base_model="b",
                                         lora_config=T.LoraConfig(rank=8),
                                         optimizer_config=T.DimuonOptimizerConfig()))
    r = W.parse_request(W.CreateModelRequest, body)
    assert isinstance(r.optimizer_config, W.DimuonConfig) and r.optimizer_config.version == 1
    # no type at all, no optimizer_config
    r = W.parse_request(W.CreateModelRequest, {"session_id": "s", "model_seq_id": 2, "base_model": "b",
                                               "optimizer_config": {}})
    assert isinstance(r.optimizer_config, W.AdamwConfig)
    assert W.parse_request(W.GetInfoRequest, sdk_body(T.GetInfoRequest(model_id="s:train:0"))).model_id == "s:train:0"
    assert W.parse_request(W.UnloadModelRequest, sdk_body(T.UnloadModelRequest(model_id="m"))).model_id == "m"


def test_optim_step_bodies():
    body = sdk_body(T.OptimStepRequest(adam_params=T.AdamParams(learning_rate=3e-4, weight_decay=0.1),
                                       model_id="m", seq_id=2))
    assert "adam_params" in body and "optim_params" not in body  # the SDK renames the key
    r = W.parse_request(W.OptimStepRequest, body)
    assert r.seq_id == 2 and r.optimizer_params is None
    p = r.params
    assert (p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm) == (3e-4, 0.9, 0.95, 1e-12, 0.1, 0.0)
    body = sdk_body(T.OptimStepRequest(optimizer_params=T.DimuonParams(learning_rate=0.02), model_id="m", seq_id=3))
    assert "optimizer_params" in body
    r = W.parse_request(W.OptimStepRequest, body)
    assert r.adam_params is None and isinstance(r.params, W.DimuonParams) and r.params.learning_rate == 0.02
    # defaults when adam_params is empty; optim_params key routed by type
    assert W.parse_request(W.OptimStepRequest, {"model_id": "m", "adam_params": {}}).params == W.AdamParams()
    r = W.parse_request(W.OptimStepRequest, {"model_id": "m", "optim_params": {"learning_rate": 0.5}})
    assert r.adam_params.learning_rate == 0.5


def test_save_and_load_bodies():
    r = W.parse_request(W.SaveWeightsRequest, sdk_body(T.SaveWeightsRequest(model_id="m", path="step-1", seq_id=4,
                                                                            ttl_seconds=7200)))
    assert (r.path, r.seq_id, r.ttl_seconds, r.overwrite) == ("step-1", 4, 7200, False)
    named = sdk_body(T.SaveWeightsForSamplerRequest(model_id="m", path="s1", seq_id=5))
    r = W.parse_request(W.SaveWeightsForSamplerRequest, named)
    assert (r.path, r.kind, r.sampling_session_seq_id) == ("s1", "snapshot", None)
    unnamed = sdk_body(T.SaveWeightsForSamplerRequest(model_id="m", sampling_session_seq_id=0, kind="inflight", seq_id=6))
    r = W.parse_request(W.SaveWeightsForSamplerRequest, unnamed)
    assert (r.path, r.kind, r.sampling_session_seq_id) == (None, "inflight", 0)
    r = W.parse_request(W.SaveWeightsExternalRequest, sdk_body(T.SaveWeightsExternalRequest(
        model_id="m", path="ext", seq_id=7, age_encryption_recipients=["age1xyz"])))
    assert r.path == "ext" and r.age_encryption_recipients == ["age1xyz"]

    create = sdk_body(T.LoadWeightsRequest(session_id="s", model_seq_id=1, path="tinker://s:train:0/weights/a",
                                           optimizer=True, base_model="b"))
    r = W.parse_request(W.LoadWeightsRequest, create)
    assert r.is_create and r.optimizer and r.model_seq_id == 1 and r.model_id is None
    inplace = sdk_body(T.LoadWeightsRequest(model_id="s:train:0", seq_id=1, path="tinker://x/weights/a", optimizer=False))
    r = W.parse_request(W.LoadWeightsRequest, inplace)
    assert not r.is_create and r.model_id == "s:train:0" and r.seq_id == 1 and r.optimizer is False


def test_sampling_bodies():
    r = W.parse_request(W.CreateSamplingSessionRequest, sdk_body(T.CreateSamplingSessionRequest(
        session_id="s", sampling_session_seq_id=0, base_model="b")))
    assert (r.base_model, r.model_path) == ("b", None)
    r = W.parse_request(W.CreateSamplingSessionRequest, sdk_body(T.CreateSamplingSessionRequest(
        session_id="s", sampling_session_seq_id=1, model_path="tinker://s:train:0/sampler_weights/x")))
    assert r.model_path.startswith("tinker://")

    body = sdk_body(T.SampleRequest(
        num_samples=3, prompt=T.ModelInput.from_ints([1, 2, 3]),
        sampling_params=T.SamplingParams(max_tokens=20, seed=7, temperature=0.7, stop=["\n\n"]),
        sampling_session_id="s:sample:0", seq_id=0, prompt_logprobs=True, topk_prompt_logprobs=2,
        prompt_logprobs_last_n=2, record_stability_info=False,
    ))
    assert body["prompt"]["chunks"][0]["type"] == "encoded_text"
    r = W.parse_request(W.SampleRequest, body)
    assert r.num_samples == 3 and r.prompt.to_tokens() == [1, 2, 3]
    sp = r.sampling_params
    assert (sp.max_tokens, sp.seed, sp.temperature, sp.top_k, sp.top_p) == (20, 7, 0.7, -1, 1.0)
    assert sp.stop_strings == ["\n\n"] and sp.stop_token_ids == []
    assert (r.prompt_logprobs, r.topk_prompt_logprobs, r.prompt_logprobs_last_n) == (True, 2, 2)
    assert r.sampling_session_id == "s:sample:0" and r.seq_id == 0

    for stop, strings, ids in [("</s>", ["</s>"], []), ([151645, 151643], [], [151645, 151643]), ([], [], []), (None, [], [])]:
        b = sdk_body(T.SampleRequest(prompt=T.ModelInput.from_ints([1]), sampling_params=T.SamplingParams(stop=stop)))
        sp = W.parse_request(W.SampleRequest, b).sampling_params
        assert (sp.stop_strings, sp.stop_token_ids) == (strings, ids)
        assert (sp.stop is None) == (stop is None)


def test_sample_target_prompt_logprobs():
    ids = torch.full((7, 6), -1, dtype=torch.int64)
    ids[0, 0], ids[3, 2], ids[6, 5] = 11, 12, 13
    from tinker.lib.public_interfaces.sampling_client import _tensor_data_to_model

    td = T.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert td.sparse_crow_indices is not None
    body = sdk_body(T.SampleRequest(prompt=T.ModelInput.from_ints(list(range(8))), sampling_params=T.SamplingParams(),
                                    target_prompt_logprobs=_tensor_data_to_model(td)))
    r = W.parse_request(W.SampleRequest, body)
    np.testing.assert_array_equal(r.target_prompt_logprobs.to_numpy(pad_value=-1), ids.numpy())
    dense = _tensor_data_to_model(T.TensorData.from_torch(ids))
    r = W.parse_request(W.SampleRequest, sdk_body(T.SampleRequest(prompt=T.ModelInput.from_ints([1]),
                                                                  sampling_params=T.SamplingParams(),
                                                                  target_prompt_logprobs=dense)))
    out = r.target_prompt_logprobs.to_numpy(pad_value=-1)
    assert out.dtype == np.int64 and out.shape == (7, 6)
    np.testing.assert_array_equal(out, ids.numpy())


def test_non_text_chunks_parse_but_are_rejected_as_tokens():
    body = sdk_body(T.SampleRequest(
        prompt=T.ModelInput(chunks=[T.EncodedTextChunk(tokens=[1]), T.ImageChunk(data=b"\x89PNG", format="png")]),
        sampling_params=T.SamplingParams()))
    r = W.parse_request(W.SampleRequest, body)
    with pytest.raises(UserError) as ei:
        r.prompt.to_tokens()
    assert ei.value.field == "prompt.chunks[1]"
    assert "not supported" in ei.value.message
    # chunk without "type": inferred from its keys
    r = W.parse_request(W.SampleRequest, {"prompt": {"chunks": [{"tokens": [4, 5]}]}})
    assert r.prompt.to_tokens() == [4, 5]


def test_rest_bodies():
    assert W.parse_request(W.WeightsInfoRequest, {"tinker_path": "tinker://a/weights/b"}).tinker_path == "tinker://a/weights/b"
    assert W.parse_request(W.TtlRequest, {"ttl_seconds": None}).ttl_seconds is None
    assert W.parse_request(W.TtlRequest, {"ttl_seconds": 3600}).ttl_seconds == 3600
    r = W.parse_request(W.CopyWeightsRequest, sdk_body(T.CopyWeightsRequest(source_path="tinker://a/weights/b",
                                                                            destination_project_id="p")))
    assert r.source_path == "tinker://a/weights/b"


def test_session_search_bodies():
    # every key the SDK's SessionSearchRequest can carry, nested unions included (refused before
    # unknown keys were: statuses[i].reasons, owner.owner_urns)
    body = sdk_body(T.SessionSearchRequest(session_id="s", display_name="run", project_ids=["p"],
                                           user_metadata={"k": "v"}, limit=5,
                                           owner=T.UserSearchOwner(owner_urns=["o1"]),
                                           statuses=[T.ActiveSessionStatusQuery(),
                                                     T.ClientFinishedSessionStatusQuery(reasons=["success"])]))
    r = W.parse_request(W.SessionSearchRequest, body)
    assert r.owner.owner_urns == ["o1"] and r.statuses[1].reasons == ["success"]


# ------------------------------------------------------------------- leniency and errors


def test_unknown_fields_refused_naming_them_and_type_not_required():
    # invariant 12: a key the server cannot honour is refused, never dropped (the SDK's own
    # request types forbid extra fields, so it never sends one)
    body = sdk_body(T.GetInfoRequest(model_id="m"))
    body.update(future_field=1)
    e = user_error(W.GetInfoRequest, body)
    assert e.field == "future_field" and "unknown field" in e.message and "model_id" in e.message
    body = sdk_body(T.SampleRequest(prompt=T.ModelInput.from_ints([1]), sampling_params=T.SamplingParams()))
    del body["type"]
    assert W.parse_request(W.SampleRequest, body).prompt.to_tokens() == [1]
    for where, field in ((("sampling_params",), "sampling_params.min_p"), (("prompt", "chunks", 0), "prompt.chunks[0].extra")):
        b = json.loads(json.dumps(body))
        target = b
        for k in where:
            target = target[k]
        target[field.rsplit(".", 1)[1]] = 0.1
        assert user_error(W.SampleRequest, b).field == field
    # a raw asample whose prompt is {"tokens": [...]}: named, not "the prompt has no tokens"
    e = user_error(W.SampleRequest, {"prompt": {"tokens": [1, 2]}, "sampling_params": {}})
    assert e.field == "prompt.tokens" and "ModelInput takes chunks" in e.message
    # an unknown key wins over a missing one: it is what the client got wrong
    assert user_error(W.SampleRequest, {"promt": {"chunks": []}}).field == "promt"
    assert user_error(W.CreateModelRequest, {"session_id": "s", "model_seq_id": 0, "base_model": "b",
                                             "type": "other"}).field == "type"
    W.parse_request(W.OptimStepRequest, {"model_id": "m", "adam_params": {}})
    assert user_error(W.OptimStepRequest, {"model_id": "m", "adam_params": {"lr": 1}}).field == "adam_params.lr"
    assert user_error(W.CreateModelRequest, {"session_id": "s", "model_seq_id": 0, "base_model": "b",
                                             "lora_config": {"rank": 4, "alpha": 8}}).field == "lora_config.alpha"


@pytest.mark.parametrize("model,body,field", [
    (W.SampleRequest, {"prompt": {"chunks": []}, "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature"),
    (W.SampleRequest, {"prompt": {"chunks": []}, "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    (W.SampleRequest, {"prompt": {"chunks": []}, "sampling_params": {"stop": [1, "a"]}}, "sampling_params.stop"),
    (W.SampleRequest, {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, "x"]}]}}, "prompt.chunks[0].tokens[1]"),
    (W.SampleRequest, {"prompt": {"chunks": [{"type": "video"}]}}, "prompt.chunks[0].type"),
    (W.SampleRequest, {"prompt": {"chunks": []}, "num_samples": 0}, "num_samples"),
    (W.SampleRequest, {"sampling_params": {}}, "prompt"),
    (W.SampleRequest, {"prompt": {"chunks": []}, "prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n"),
    (W.SampleRequest, {"prompt": {"chunks": []}, "target_prompt_logprobs": {"data": [1.0], "dtype": "float32", "shape": [1, 1]}},
     "target_prompt_logprobs.dtype"),
    (W.SampleRequest, {"prompt": {"chunks": []}, "target_prompt_logprobs": {"data": [1], "dtype": "int64",
                                                                           "sparse_crow_indices": [0, 1]}},
     "target_prompt_logprobs.sparse_col_indices"),
    (W.OptimStepRequest, {"model_id": "m", "adam_params": {"learning_rate": -1}}, "adam_params.learning_rate"),
    (W.OptimStepRequest, {"model_id": "m", "adam_params": {"learning_rate": float("inf")}}, "adam_params.learning_rate"),
    (W.OptimStepRequest, {"model_id": "m", "adam_params": {"beta1": 1.0}}, "adam_params.beta1"),
    (W.OptimStepRequest, {"model_id": "m", "adam_params": {"beta2": -0.1}}, "adam_params.beta2"),
    (W.OptimStepRequest, {"model_id": "m", "adam_params": {"eps": 0}}, "adam_params.eps"),
    (W.OptimStepRequest, {"model_id": "m"}, "adam_params"),
    (W.OptimStepRequest, {"adam_params": {}}, "model_id"),
    (W.OptimStepRequest, {"model_id": "m", "optimizer_params": {"type": "sgd", "learning_rate": 1}}, "optimizer_params.type"),
    (W.CreateModelRequest, {"session_id": "s", "model_seq_id": 0, "base_model": "b", "lora_config": {"rank": 0}},
     "lora_config.rank"),
    (W.CreateModelRequest, {"session_id": "s", "model_seq_id": 0, "base_model": "b", "optimizer_config": {"type": "sgd"}},
     "optimizer_config.type"),
    (W.CreateModelRequest, {"session_id": "s", "model_seq_id": "x", "base_model": "b"}, "model_seq_id"),
    (W.LoadWeightsRequest, {"path": "tinker://a/weights/b", "optimizer": False}, "model_id"),
    (W.LoadWeightsRequest, {"session_id": "s", "path": "tinker://a/weights/b", "optimizer": False}, "model_seq_id"),
    (W.SaveWeightsRequest, {"model_id": "m", "path": "../x"}, "path"),
    (W.SaveWeightsRequest, {"model_id": "m", "path": "ok", "ttl_seconds": 0}, "ttl_seconds"),
    (W.SaveWeightsForSamplerRequest, {"model_id": "m"}, "path"),
    (W.CreateSamplingSessionRequest, {"session_id": "s", "sampling_session_seq_id": 0}, "base_model"),
])
def test_bad_values_name_the_field(model, body, field):
    err = user_error(model, body)
    assert err.field == field, str(err)
    assert str(err).startswith(f"{field}: ")


def test_body_level_errors():
    assert user_error(W.GetInfoRequest, b"{not json").field == "body"
    assert user_error(W.GetInfoRequest, b"[1, 2]").field == "body"
    assert user_error(W.GetInfoRequest, b"").field == "model_id"  # empty body = {}


def test_validation_error_to_user_error_direct():
    with pytest.raises(pydantic.ValidationError) as ei:
        W.SampleRequest.model_validate({"prompt": {"chunks": []}, "sampling_params": {"temperature": "hot"}})
    err = W.validation_error_to_user_error(ei.value)  # model found from the error's title
    assert isinstance(err, UserError) and err.field == "sampling_params.temperature"


def test_tensor_data_to_numpy_errors():
    td = W.TensorData(data=[1, 2, 3], dtype="int64", shape=[2, 2])
    with pytest.raises(UserError) as ei:
        td.to_numpy(field="target_prompt_logprobs")
    assert ei.value.field == "target_prompt_logprobs"
    assert W.TensorData(data=[1, 2], dtype="float32").to_numpy().dtype == np.float32


# ------------------------------------------------------------- responses parse in the SDK


def test_responses_parse_in_sdk():
    now = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    ckpt = W.Checkpoint(checkpoint_id="weights/a", checkpoint_type="training", time=now,
                        tinker_path="tinker://s:train:0/weights/a", size_bytes=10)
    cases = [
        (W.UntypedAPIFuture(request_id="r", sample_sequence_ids=["a", "b"]), T.UntypedAPIFuture),
        (W.RequestFailedResponse(error="bad", category="user"), T.RequestFailedResponse),
        (W.CreateSessionResponse(session_id="s"), T.CreateSessionResponse),
        (W.SessionHeartbeatResponse(), T.SessionHeartbeatResponse),
        (W.TelemetryResponse(), T.TelemetryResponse),
        (W.ClientConfigResponse(), T.ClientConfigResponse),
        (W.ClientDynamicConfigResponse(), T.ClientDynamicConfigResponse),
        (W.CreateModelResponse(model_id="s:train:0"), T.CreateModelResponse),
        (W.GetInfoResponse(model_id="m", model_data=W.ModelData(arch="qwen3", model_name="Qwen/Qwen3-8B",
                                                                tokenizer_id="Qwen/Qwen3-8B"),
                           is_lora=True, lora_rank=8, model_name="Qwen/Qwen3-8B"), T.GetInfoResponse),
        (W.GetInfoResponse(model_id="m", model_data=W.ModelData(), optimizer_config=W.DimuonConfig()), T.GetInfoResponse),
        (W.OptimStepResponse(metrics={"grad_norm:mean": 1.0}), T.OptimStepResponse),
        (W.SaveWeightsResponse(path="tinker://s:train:0/weights/a"), T.SaveWeightsResponse),
        (W.SaveWeightsForSamplerResponse(sampling_session_id="s:sample:0"), T.SaveWeightsForSamplerResponseInternal),
        (W.SaveWeightsExternalResponse(path="tinker://m/external_weights/a", size_bytes=3), T.SaveWeightsExternalResponseInternal),
        (W.LoadWeightsResponse(model_id="m"), T.LoadWeightsResponse),
        (W.UnloadModelResponse(model_id="m"), T.UnloadModelResponse),
        (W.CreateSamplingSessionResponse(sampling_session_id="s:sample:1"), T.CreateSamplingSessionResponse),
        (W.SamplerInfo(sampler_id="s:sample:1", base_model="b"), T.GetSamplerResponse),
        (ckpt, T.Checkpoint),
        (W.CheckpointsListResponse(checkpoints=[ckpt], cursor=W.Cursor(offset=0, limit=100, total_count=1)),
         T.CheckpointsListResponse),
        (W.TrainingRunsResponse(training_runs=[W.TrainingRun(
            training_run_id="s:train:0", base_model="b", model_owner="me", is_lora=True, lora_rank=8,
            last_request_time=now, last_checkpoint=ckpt)], cursor=W.Cursor(offset=0, limit=20, total_count=1)),
         T.TrainingRunsResponse),
        (W.WeightsInfoResponse(base_model="b", is_lora=True, lora_rank=8), T.WeightsInfoResponse),
        (W.GetServerCapabilitiesResponse(supported_models=[W.SupportedModel(model_name="b")]), T.GetServerCapabilitiesResponse),
        (W.ExternalWeightsUrlsResponse(urls={"a": "file:///x"}, expires=now), T.ExternalWeightsUrlsResponse),
        (W.ListSessionsResponse(sessions=["s"]), T.ListSessionsResponse),
        (W.GetSessionResponse(training_run_ids=["s:train:0"], sampler_ids=[]), T.GetSessionResponse),
        (W.HealthResponse(), T.HealthResponse),
    ]
    for ours, sdk_cls in cases:
        payload = json.loads(json.dumps(W.dump(ours)))
        parsed = sdk_cls.model_validate(payload)
        assert parsed is not None, sdk_cls
    tr = W.dump(W.TryAgainResponse(request_id="r"))
    assert tr == {"type": "try_again", "request_id": "r", "queue_state": "active"}
    info = T.GetInfoResponse.model_validate(W.dump(cases[8][0]))
    assert info.model_data.tokenizer_id == "Qwen/Qwen3-8B" and info.optimizer_config.type == "adamw"
