"""Training routes: each validates at the edge, records a pending future and publishes
one CloudEvent to the trainer shard that holds the training run.

Request ids are derived from (training run, seq_id), so a retried duplicate gets the
same future back and is never published twice (invariant 2). A sequenced request rejected
here has its seq_id skipped by the route class (:class:`functions.gateway.skips.SkipRejected`).

The path of a forward_backward, for instance: ``BodyCapMiddleware`` (size cap) →
:func:`functions.gateway.deps.authenticate` (key) → :data:`functions.gateway.fwdbwd.ForwardBackwardDep`
(decode) → :func:`forward_backward` (the run, edge checks) → :func:`enqueue` (backpressure,
future, event).
"""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import APIRouter

from functions.gateway.context import Gateway, require
from functions.gateway.deps import API_PREFIX, CallerDep, GatewayDep
from functions.gateway.fwdbwd import ForwardBackwardDep, renamed, validate_datums, with_seq_id
from functions.gateway.numbering import check_seq_id, numbered
from functions.gateway.runs import checkpoint_path, check_optimizer, new_run, readable_manifest, refuse_frozen
from functions.gateway.skips import SkipRejected, request_id_for
from openrl.contract import payloads
from openrl.contract.records import SamplerSession, TrainingRun
from openrl.edge import wire
from openrl.errors import NotSupported, UserError
from openrl.storage import TinkerPath
from openrl.transport.bus import TRAIN_STREAM, now_iso

router = APIRouter(prefix=API_PREFIX, route_class=SkipRejected)
FUTURE = wire.UntypedAPIFuture


async def enqueue(g: Gateway, run: TrainingRun, op: str, seq_id: int, data: dict | bytes, tokens: int = 0) -> dict:
    """Publish request ``seq_id`` of ``run``: backpressure and the key's quotas (429, not skipped:
    the SDK resends; ``tokens``: the request's, for ``tokens_per_min``), the pending future, the
    event. Returns the future handle ``{request_id, model_id}``."""
    rid = request_id_for(run.model_id, seq_id)
    await g.admit(TRAIN_STREAM, rid, owner=run.owner, op=op, tokens=tokens)
    await g.submit(op, rid, run.model_id, data, shard=run.shard, future_meta={"owner": run.owner})
    return {"request_id": rid, "model_id": run.model_id}


async def sequenced(g: Gateway, run: TrainingRun, op: str, seq_id: int | None,
                    data: dict | Callable[[int], Awaitable[dict]]) -> dict:
    """Publish JSON training request ``seq_id`` of ``run``: ``data`` plus the run and seq_id,
    as the op's :mod:`openrl.contract.payloads` model. Without ``seq_id`` the gateway numbers
    the request (:mod:`functions.gateway.numbering`); ``data`` may then depend on the number:
    ``async data(seq_id) -> dict``.

    Raises:
        UserError: seq_id outside [1, MAX_SEQ_ID], or numbered the other way than the run's
            other requests; the run is a frozen copy.
    """
    refuse_frozen(run)

    async def publish(n: int) -> dict:
        fields = await data(n) if callable(data) else data
        payload = payloads.PAYLOADS[op].model_validate({"model_id": run.model_id, "seq_id": n, **fields})
        return await enqueue(g, run, op, n, payload.to_data())

    if seq_id is None:
        return await numbered(g, run, publish)
    check_seq_id(run, seq_id)
    return await publish(seq_id)


@router.post("/create_model", response_model=FUTURE)
async def create_model(req: wire.CreateModelRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """A new training run (LoRA rank 1-512, AdamW) in the caller's session; a retry gets the same future."""
    lora = req.lora_config.model_dump() if req.lora_config else {"rank": 32}
    require(1 <= int(lora.get("rank", 32)) <= 512, "lora_config.rank", "must be between 1 and 512")
    opt = req.optimizer_config.model_dump() if getattr(req, "optimizer_config", None) else {"type": "adamw"}
    check_optimizer(opt)
    await g.admit_run(caller.owner, f"{req.session_id}:train:{req.model_seq_id}")  # the key's runs quota
    run = await new_run(g, caller.owner, req.session_id, req.model_seq_id, req.base_model, lora,
                        {"optimizer_config": opt, "user_metadata": req.user_metadata or {}})
    data = payloads.CreateModel(model_id=run.model_id, base_model=run.base_model, lora_config=lora,
                                optimizer_config=opt).to_data()
    rid = request_id_for(run.model_id, 0)
    await g.submit("create_model", rid, run.model_id, data, shard=run.shard, future_meta={"owner": run.owner})
    return {"request_id": rid, "model_id": run.model_id}


@router.post("/get_info", response_model=wire.GetInfoResponse)
async def get_info(req: wire.GetInfoRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """Base model, tokenizer id and LoRA rank of one of the caller's runs (synchronous)."""
    run = await g.model(req.model_id, caller.owner)
    out = {
        "type": "get_info",
        "model_id": run.model_id,
        "model_data": {"arch": "qwen3", "model_name": run.base_model, "tokenizer_id": run.tokenizer_id},
        "is_lora": True,
        "lora_rank": run.lora_config.rank,
        "model_name": run.base_model,
    }
    if run.optimizer_config is not None:  # else the model's default (adamw)
        out["optimizer_config"] = run.optimizer_config
    return out


@router.post("/forward_backward", response_model=FUTURE)
@router.post("/forward", response_model=FUTURE)
async def forward_backward(body: ForwardBackwardDep, g: GatewayDep, caller: CallerDep) -> dict:
    """Protobuf ForwardBackwardRequest (zstd when Content-Encoding says so; the decompressed
    body is the event's data), or its JSON form (encoded as protobuf here; see
    :mod:`functions.gateway.fwdbwd`)."""
    fb = body.request
    run = await g.model(fb.model_id, caller.owner)
    if fb.seq_id:  # 0: none (proto3's default; the SDK's seq_ids start at 1), numbered below
        check_seq_id(run, fb.seq_id)
    refuse_frozen(run)
    base = g.registry.resolve(run.base_model)
    try:
        validate_datums(fb, g.vocab_size(run.base_model), base.max_context_length)
    except UserError as exc:
        raise renamed(exc, body.prefix + exc.field) from None
    op, tokens = "forward" if fb.forward_only else "forward_backward", sum(len(d.tokens) for d in fb.data)
    if fb.seq_id:
        return await enqueue(g, run, op, fb.seq_id, body.data, tokens=tokens)

    async def publish(n: int) -> dict:
        return await enqueue(g, run, op, n, with_seq_id(body.data, n), tokens=tokens)

    return await numbered(g, run, publish)


@router.post("/optim_step", response_model=FUTURE)
async def optim_step(req: wire.OptimStepRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """One AdamW step of the caller's run (``adam_params``; other optimizers are refused)."""
    if req.optimizer_params is not None or req.adam_params is None:
        raise NotSupported("optimizer_params", "only AdamW steps (adam_params) are implemented")
    run = await g.model(req.model_id, caller.owner)
    return await sequenced(g, run, "optim_step", req.seq_id, {"adam_params": req.adam_params.model_dump()})


@router.post("/save_weights", response_model=FUTURE)
async def save_weights(req: wire.SaveWeightsRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """Save adapter + optimizer state as ``tinker://<run>/weights/<path or state-<seq_id>>``."""
    if req.path:
        checkpoint_path(req.model_id, "weights", req.path)  # a bad name: refused before it is numbered
    run = await g.model(req.model_id, caller.owner)

    async def data(n: int) -> dict:
        return {"path": checkpoint_path(req.model_id, "weights", req.path or f"state-{n}"),
                "ttl_seconds": req.ttl_seconds, "owner": caller.owner,
                **({"user_metadata": req.user_metadata} if req.user_metadata else {})}

    return await sequenced(g, run, "save_weights", req.seq_id, data)


@router.post("/save_weights_for_sampler", response_model=FUTURE)
async def save_weights_for_sampler(req: wire.SaveWeightsForSamplerRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """Named: a sampler snapshot. Unnamed: a snapshot plus a new sampling session."""
    run = await g.model(req.model_id, caller.owner)
    refuse_frozen(run)
    data = {"ttl_seconds": req.ttl_seconds, "owner": caller.owner,
            **({"user_metadata": req.user_metadata} if req.user_metadata else {})}
    if req.path:
        data["path"] = checkpoint_path(req.model_id, "sampler_weights", req.path)
        return await sequenced(g, run, "save_weights_for_sampler", req.seq_id, data)
    require(req.sampling_session_seq_id is not None, "sampling_session_seq_id", "required when path is omitted")
    sid = f"{run.session_id}:sample:{req.sampling_session_seq_id}"

    async def unnamed(n: int) -> dict:
        path = checkpoint_path(req.model_id, "sampler_weights", f"s{n}-{req.sampling_session_seq_id}")
        await g.bus.meta_put(SamplerSession.make(sampler_id=sid, owner=run.owner, base_model=run.base_model,
                                                 model_path=path, session_id=run.session_id, created=now_iso()),
                             "sampler", sid)
        return {**data, "path": path, "sampling_session_id": sid}

    return await sequenced(g, run, "save_weights_for_sampler", req.seq_id, unnamed)


@router.post("/load_weights", response_model=FUTURE)
async def load_weights(req: wire.LoadWeightsRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """Create-via-load (session_id + model_seq_id) or the legacy in-place load (model_id + seq_id).

    In-place loads (``TrainingClient.load_state*``) follow hosted Tinker: a load is accepted only
    as the run's first request (``seq_id == 1``), before any forward_backward / optim_step /
    save; later ones are refused with 400 (see docs/compatibility.md). The SDK deprecates
    ``load_state*`` in favour of ``ServiceClient.create_training_client_from_state*``, which
    starts a fresh run from the checkpoint.
    """
    if req.weights_access_token:
        raise NotSupported("weights_access_token", "this server issues no weights access tokens; a checkpoint "
                           "your API key can read (your own, or a published one) needs none")
    if req.model_id is not None:
        def first_only(n: int | None) -> None:
            require(n == 1, "seq_id",
                    f"load_state is accepted only as a training run's first request (this is request "
                    f"{n}); create a new training client from the checkpoint with "
                    "ServiceClient.create_training_client_from_state(path) instead")

        if req.seq_id is not None:
            first_only(req.seq_id)
        ckpt = TinkerPath.parse(req.path, field="path")
        await readable_manifest(g, ckpt, caller.owner)
        run = await g.model(req.model_id, caller.owner)

        async def data(n: int) -> dict:
            first_only(n)  # numbered by the gateway: a number other than 1 is refused (and skipped)
            return {"path": str(ckpt), "optimizer": req.optimizer, "create": False}

        return await sequenced(g, run, "load_weights", req.seq_id, data)
    # create-via-load (ServiceClient.create_training_client_from_state*)
    ckpt = TinkerPath.parse(req.path, field="path")
    manifest = await readable_manifest(g, ckpt, caller.owner)
    if req.optimizer_config is not None:
        check_optimizer(req.optimizer_config.model_dump())
    require(req.session_id is not None and req.model_seq_id is not None, "session_id",
            "create-via-load needs session_id and model_seq_id")
    base = req.base_model or manifest.base_model
    lora = (manifest.lora_config.stored() if manifest.lora_config is not None else {}) or {
        "rank": 32 if manifest.lora_rank is None else manifest.lora_rank}
    opt = req.optimizer_config.model_dump() if getattr(req, "optimizer_config", None) else (
        manifest.optimizer_config or {"type": "adamw"})
    await g.admit_run(caller.owner, f"{req.session_id}:train:{req.model_seq_id}")  # the key's runs quota
    run = await new_run(g, caller.owner, req.session_id, req.model_seq_id, base, lora,
                        {"optimizer_config": opt, "user_metadata": req.user_metadata or {}})
    rid = request_id_for(run.model_id, 0)
    data = payloads.LoadWeights(model_id=run.model_id, base_model=base, lora_config=lora, optimizer_config=opt,
                                path=str(ckpt), optimizer=req.optimizer, create=True, seq_id=0).to_data()
    await g.submit("load_weights", rid, run.model_id, data, shard=run.shard, future_meta={"owner": caller.owner})
    return {"request_id": rid, "model_id": run.model_id}


@router.post("/save_weights_external", response_model=FUTURE)
async def save_weights_external(req: wire.SaveWeightsExternalRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """``TrainingClient.save_weights_external``: the PEFT adapter as an ``external_weights``
    checkpoint (``tinker://<run>/external_weights/<name>``), downloadable through
    ``RestClient.get_external_weights_urls``. Future result ``{path, size_bytes}``.

    With ``age_encryption_recipients`` every stored file is age ciphertext ``<file>.age``
    (see :func:`functions.gateway.routes_download.request_age_encryption`).

    Raises:
        UserError: bad ``age_encryption_recipients[i]`` (or an empty / over-long list).
    """
    from functions.gateway.routes_download import request_age_encryption

    if req.path:
        checkpoint_path(req.model_id, "external_weights", req.path)  # a bad name: refused before it is numbered
    run = await g.model(req.model_id, caller.owner)

    async def data(n: int) -> dict:
        path = checkpoint_path(req.model_id, "external_weights", req.path or f"external-{n}")
        await request_age_encryption(g, TinkerPath.parse(path), n, req.age_encryption_recipients)
        return {"path": path, "ttl_seconds": req.ttl_seconds, "owner": caller.owner}

    return await sequenced(g, run, "save_weights_external", req.seq_id, data)


@router.post("/unload_model", response_model=FUTURE)
async def unload_model(req: wire.UnloadModelRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """Drop a run of the caller from the trainer (request id ``<model_id>:unload``)."""
    run = await g.model(req.model_id, caller.owner)
    rid = f"{req.model_id}:unload"
    await g.submit("unload_model", rid, req.model_id, payloads.UnloadModel(model_id=req.model_id, seq_id=None).to_data(),
                   shard=run.shard, future_meta={"owner": run.owner})
    return {"request_id": rid, "model_id": req.model_id}

