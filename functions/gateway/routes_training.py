"""Training routes: each validates at the edge, records a pending future and publishes
one CloudEvent to the trainer shard that holds the training run.

Request ids are derived from (training run, seq_id), so a retried duplicate gets the
same future back and is never published twice (invariant 2).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from functions.gateway.context import BodyTooLarge, require
from functions.gateway.deps import gw, owner, parse
from openrl.contract import payloads
from openrl.edge import proto
from openrl.edge import wire
from openrl.transport.bus import TRAIN_STREAM, now_iso
from openrl.errors import UserError
from openrl.storage import TinkerPath

router = APIRouter(prefix="/api/v1")

MAX_SEQ_ID = 2**31 - 1  # seq_id is an int32 on the SDK's protobuf wire


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """Training-run id, fixed by the SDK: ``<session_id>:train:<model_seq_id>``."""
    return f"{session_id}:train:{model_seq_id}"


def request_id_for(model_id: str, seq_id: int) -> str:
    """The future id of a training request (0 is the creation)."""
    return f"{model_id}:{seq_id}"


async def _new_run(request: Request, session_id: str, model_seq_id: int, base_model: str, lora: dict, extra: dict) -> dict:
    g = gw(request)
    who = owner(request)
    await g.session(session_id, who)
    entry = g.registry.resolve(base_model)
    model_id = model_id_for(session_id, model_seq_id)
    rec = {
        "model_id": model_id,
        "session_id": session_id,
        "owner": who,
        "base_model": base_model,
        "lora_config": lora,
        "tokenizer_id": entry.tokenizer_id,
        "shard": g.shard_of(model_id),
        "created": now_iso(),
        "last_request_time": now_iso(),
        **extra,
    }
    if await g.bus.meta_create(rec, "model", model_id):

        def add(old):
            old = dict(old or {})
            old.setdefault("training_run_ids", []).append(model_id)
            return old

        await g.bus.meta_update(add, "session", session_id)
    else:
        rec = await g.model(model_id, who)
    return rec


def refuse_frozen(rec: dict) -> None:
    """Training calls on a run made by copy_weights (:mod:`functions.gateway.routes_copy`) are refused.

    Raises:
        UserError: naming ``model_id``.
    """
    if rec.get("frozen"):
        raise UserError("model_id", f"training run {rec['model_id']!r} holds a copy made by copy_weights "
                        f"(of {rec.get('copy_of')}) and cannot be trained on; create_training_client_from_state "
                        "from the copy's path trains a new run from it")


async def _refuse_if_frozen(g, rec: dict, seq_id: int | None) -> None:
    """:func:`refuse_frozen`, after skipping ``seq_id`` (the SDK has used it up)."""
    if rec.get("frozen"):
        if seq_id is not None and 1 <= seq_id <= MAX_SEQ_ID:
            await _skip(g, rec, seq_id)
        refuse_frozen(rec)


def _check_optimizer(opt: dict, field_name: str = "optimizer_config") -> None:
    """Only AdamW is implemented; anything else is refused when the run is created.

    Raises:
        NotSupported: ``opt["type"]`` is not ``"adamw"`` (e.g. ``"dimuon"``).
    """
    from openrl.errors import NotSupported

    kind = (opt or {}).get("type", "adamw")
    if kind != "adamw":
        raise NotSupported(field_name, f"optimizer {kind!r}; this server trains with AdamW only "
                                       "(create the training client without optimizer_config, or with type 'adamw')")


@router.post("/create_model")
async def create_model(request: Request) -> dict:
    req = await parse(request, wire.CreateModelRequest)
    lora = req.lora_config.model_dump() if req.lora_config else {"rank": 32}
    require(1 <= int(lora.get("rank", 32)) <= 512, "lora_config.rank", "must be between 1 and 512")
    opt = req.optimizer_config.model_dump() if getattr(req, "optimizer_config", None) else {"type": "adamw"}
    _check_optimizer(opt)
    rec = await _new_run(
        request, req.session_id, req.model_seq_id, req.base_model, lora,
        {"optimizer_config": opt, "user_metadata": req.user_metadata or {}},
    )
    rid = request_id_for(rec["model_id"], 0)
    data = payloads.CreateModel(model_id=rec["model_id"], base_model=rec["base_model"], lora_config=lora,
                                optimizer_config=opt).to_data()
    await gw(request).submit("create_model", rid, rec["model_id"], data, model=rec, future_meta={"owner": rec["owner"]})
    return {"request_id": rid, "model_id": rec["model_id"]}


@router.post("/get_info")
async def get_info(request: Request) -> dict:
    req = await parse(request, wire.GetInfoRequest)
    rec = await gw(request).model(req.model_id, owner(request))
    lora = rec.get("lora_config") or {}
    return {
        "type": "get_info",
        "model_id": rec["model_id"],
        "model_data": {"arch": "qwen3", "model_name": rec["base_model"], "tokenizer_id": rec["tokenizer_id"]},
        "is_lora": True,
        "lora_rank": lora.get("rank"),
        "model_name": rec["base_model"],
        "optimizer_config": rec.get("optimizer_config"),
    }


@router.post("/forward_backward")
@router.post("/forward")
async def forward_backward(request: Request) -> dict:
    """Protobuf ForwardBackwardRequest (zstd when Content-Encoding says so)."""
    g = gw(request)
    body = await request.body()
    encoding = request.headers.get("content-encoding")
    oversize = getattr(request.state, "oversize", None)
    if oversize is not None:  # only the head was read (functions/gateway/app.py EdgeMiddleware)
        await _skip_head(request, body, encoding)
        raise BodyTooLarge("body", f"request body of {oversize} bytes exceeds the limit of {g.body_limit()} bytes")
    if "protobuf" not in (request.headers.get("content-type") or ""):
        raise UserError("content-type", "forward_backward expects application/x-protobuf")
    try:
        body = _decompress_capped(body, encoding, g.body_limit())
        fb = proto.decode_forward_backward_request(body)
    except UserError:  # BodyTooLarge included
        await _skip_head(request, body[:proto.HEAD_BYTES], encoding)
        raise
    rec = await g.model(fb.model_id, owner(request))
    require(fb.seq_id >= 1, "seq_id", "must be >= 1")
    try:
        refuse_frozen(rec)
        _validate_datums(fb, g.vocab_size(rec["base_model"]), g.registry.resolve(rec["base_model"]).max_context_length)
    except UserError:
        await _skip(g, rec, fb.seq_id)
        raise
    op = "forward" if fb.forward_only else "forward_backward"
    rid = request_id_for(fb.model_id, fb.seq_id)
    await g.admit(TRAIN_STREAM, rid)  # 429: the SDK resends this seq_id later, so no skip
    await g.submit(op, rid, fb.model_id, body, model=rec,
                   future_meta={"owner": rec["owner"]})
    return {"request_id": rid, "model_id": fb.model_id}


def _decompress_capped(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body, zstd-decompressed when ``encoding`` says so, at most ``limit`` bytes either way.

    Raises:
        UserError: ``Content-Encoding`` not zstd/identity; ``body`` not valid zstd.
        BodyTooLarge: more than ``limit`` bytes (413; a small zstd body cannot expand without bound).
    """
    enc = (encoding or "").strip().lower()
    if enc not in ("", "identity", "zstd"):
        raise UserError("Content-Encoding", f"unsupported encoding {encoding!r}; use zstd")
    if enc == "zstd":
        import io

        import zstandard

        out = bytearray()
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body))
            while chunk := reader.read(1 << 20):
                out += chunk
                if len(out) > limit:
                    break
        except zstandard.ZstdError as exc:
            raise UserError("body", f"malformed zstd body: {exc}") from None
        body = bytes(out)
    if len(body) > limit:
        raise BodyTooLarge("body", f"forward_backward body exceeds the limit of {limit} bytes")
    return body


def _validate_datums(fb, vocab: int, max_context: int | None = None) -> None:
    """Edge checks of a forward_backward body: non-empty, token ids in the vocabulary, at most
    ``max_context`` tokens per datum, target lengths, finite float inputs (no NaN/inf).

    Raises:
        UserError: naming the datum and field.
    """
    import numpy as np

    require(len(fb.data) > 0, "data", "at least one datum is required")
    for i, d in enumerate(fb.data):
        require(len(d.tokens) > 0, f"data[{i}].model_input", "empty model input")
        require(max_context is None or len(d.tokens) <= max_context, f"data[{i}].model_input",
                f"{len(d.tokens)} tokens exceed the model's context of {max_context}")
        bad = [t for t in d.tokens if t < 0 or t >= vocab]
        require(not bad, f"data[{i}].model_input", f"token id {bad[:1]} outside the vocabulary [0, {vocab})")
        for key, arr in d.loss_fn_inputs.items():
            a = np.asarray(arr)
            fld = f"data[{i}].loss_fn_inputs.{key}"
            require(a.ndim >= 1 and a.shape[0] == len(d.tokens), fld,
                    f"shape {list(a.shape)}: the first dimension must be the model_input length {len(d.tokens)}")
            require(a.dtype.kind != "f" or bool(np.isfinite(a).all()), fld, "must be finite (no NaN or inf)")
        tt = d.loss_fn_inputs.get("target_tokens")
        if tt is not None:
            require(tt.shape[0] == len(d.tokens), f"data[{i}].loss_fn_inputs.target_tokens",
                    f"length {tt.shape[0]} != model_input length {len(d.tokens)}")
            require(bool(((tt >= 0) & (tt < vocab)).all()), f"data[{i}].loss_fn_inputs.target_tokens",
                    f"token id outside the vocabulary [0, {vocab})")


async def _skip(g, rec: dict, seq_id: int) -> None:
    """Tell the trainer that ``seq_id`` of a run was rejected at the edge and will never come.

    The SDK numbers every call, and a call answered with a 4xx is never resent, so
    without this the run's later requests would wait for the missing seq_id until the
    gap timeout.
    """
    rid = f"{request_id_for(rec['model_id'], seq_id)}:skip"
    await g.submit("skip", rid, rec["model_id"], payloads.Skip(model_id=rec["model_id"], seq_id=seq_id).to_data(),
                   model=rec)


async def _skip_head(request: Request, head: bytes, encoding: str | None) -> None:
    """A forward_backward body the gateway will not decode (too large, broken datums) may
    still name the caller's run and a seq_id in its first bytes: skip that seq_id."""
    model_id, seq_id = proto.peek_run_and_seq(head, encoding)
    if model_id is not None and seq_id is not None:
        await _skip_owned(request, model_id, seq_id)


async def _model_from_raw(request: Request):
    """(run record, seq_id) from a JSON body that failed validation, when both are usable."""
    import json

    try:
        raw = json.loads(await request.body())
        rec = await gw(request).model(str(raw["model_id"]), owner(request))
        return rec, int(raw["seq_id"])
    except Exception:  # noqa: BLE001 - best effort only
        return None, None


async def _parse_training(request: Request, model):
    """Parse a JSON training request; on a field error, skip its seq_id (see :func:`_skip`)."""
    try:
        return await parse(request, model)
    except UserError:
        rec, seq_id = await _model_from_raw(request)
        if rec is not None and seq_id is not None and seq_id >= 1:
            await _skip(gw(request), rec, seq_id)
        raise


async def _simple(request: Request, op: str, req, data: dict) -> dict:
    """Publish a sequenced training request: ``data`` plus the run and seq_id, as the op's
    :mod:`openrl.contract.payloads` model."""
    g = gw(request)
    rec = await g.model(req.model_id, owner(request))
    require(req.seq_id is not None and 1 <= req.seq_id <= MAX_SEQ_ID, "seq_id", f"must be between 1 and {MAX_SEQ_ID}")
    await _refuse_if_frozen(g, rec, req.seq_id)
    rid = request_id_for(req.model_id, req.seq_id)
    data = payloads.PAYLOADS[op].model_validate({"model_id": req.model_id, "seq_id": req.seq_id, **data}).to_data()
    await g.admit(TRAIN_STREAM, rid)
    await g.submit(op, rid, req.model_id, data, model=rec, future_meta={"owner": rec["owner"]})
    return {"request_id": rid, "model_id": req.model_id}


@router.post("/optim_step")
async def optim_step(request: Request) -> dict:
    req = await _parse_training(request, wire.OptimStepRequest)
    if req.optimizer_params is not None or req.adam_params is None:
        from openrl.errors import NotSupported

        await _skip_owned(request, req.model_id, req.seq_id)
        raise NotSupported("optimizer_params", "only AdamW steps (adam_params) are implemented")
    return await _simple(request, "optim_step", req, {"adam_params": req.adam_params.model_dump()})


def _checkpoint_path(model_id: str, kind: str, name: str) -> str:
    return str(TinkerPath.parse(f"tinker://{model_id}/{kind}/{name}", field="path"))


@router.post("/save_weights")
async def save_weights(request: Request) -> dict:
    req = await _parse_training(request, wire.SaveWeightsRequest)
    name = req.path or f"state-{req.seq_id}"
    path = _checkpoint_path(req.model_id, "weights", name)
    return await _simple(request, "save_weights", req, {"path": path, "ttl_seconds": req.ttl_seconds,
                                                         "owner": owner(request)})


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request) -> dict:
    """Named: a sampler snapshot. Unnamed: a snapshot plus a new sampling session."""
    req = await _parse_training(request, wire.SaveWeightsForSamplerRequest)
    g = gw(request)
    rec = await g.model(req.model_id, owner(request))
    await _refuse_if_frozen(g, rec, req.seq_id)
    data = {"ttl_seconds": req.ttl_seconds, "owner": owner(request)}
    if req.path:
        data["path"] = _checkpoint_path(req.model_id, "sampler_weights", req.path)
    else:
        require(req.sampling_session_seq_id is not None, "sampling_session_seq_id", "required when path is omitted")
        sid = f"{rec['session_id']}:sample:{req.sampling_session_seq_id}"
        path = _checkpoint_path(req.model_id, "sampler_weights", f"s{req.seq_id}-{req.sampling_session_seq_id}")
        data.update(path=path, sampling_session_id=sid)
        await g.bus.meta_put(
            {"sampler_id": sid, "owner": rec["owner"], "base_model": rec["base_model"], "model_path": path,
             "session_id": rec["session_id"], "created": now_iso()},
            "sampler", sid,
        )
    return await _simple(request, "save_weights_for_sampler", req, data)


async def _skip_owned(request: Request, model_id: str | None, seq_id: int | None) -> None:
    """Skip ``seq_id`` of the caller's run ``model_id`` (best effort; see :func:`_skip`)."""
    try:
        rec = await gw(request).model(str(model_id), owner(request))
    except Exception:  # noqa: BLE001 - not the caller's run: nothing to skip
        return
    if seq_id is not None and 1 <= seq_id <= MAX_SEQ_ID:
        await _skip(gw(request), rec, seq_id)


@router.post("/load_weights")
async def load_weights(request: Request) -> dict:
    """Create-via-load (session_id + model_seq_id) or the legacy in-place load (model_id + seq_id).

    In-place loads (``TrainingClient.load_state*``) follow hosted Tinker: a load is accepted only
    as the run's first request (``seq_id == 1``), before any forward_backward / optim_step /
    save; later ones are refused with 400 (see docs/compatibility.md). The SDK deprecates
    ``load_state*`` in favour of ``ServiceClient.create_training_client_from_state*``, which
    starts a fresh run from the checkpoint.
    """
    req = await _parse_training(request, wire.LoadWeightsRequest)
    g = gw(request)
    who = owner(request)
    if req.model_id is not None:
        try:
            require(req.seq_id == 1, "seq_id",
                    f"load_state is accepted only as a training run's first request (this is request "
                    f"{req.seq_id}); create a new training client from the checkpoint with "
                    "ServiceClient.create_training_client_from_state(path) instead")
            ckpt = TinkerPath.parse(req.path, field="path")
            await _owned_manifest(g, ckpt, who)
        except UserError:
            await _skip_owned(request, req.model_id, req.seq_id)
            raise
        return await _simple(request, "load_weights", req,
                             {"path": str(ckpt), "optimizer": req.optimizer, "create": False})
    ckpt = TinkerPath.parse(req.path, field="path")
    manifest = await _owned_manifest(g, ckpt, who)
    if req.optimizer_config is not None:
        _check_optimizer(req.optimizer_config.model_dump())
    # create-via-load (ServiceClient.create_training_client_from_state*)
    require(req.session_id is not None and req.model_seq_id is not None, "session_id",
            "create-via-load needs session_id and model_seq_id")
    base = req.base_model or manifest.get("base_model")
    lora = manifest.get("lora_config") or {"rank": manifest.get("lora_rank", 32)}
    opt = req.optimizer_config.model_dump() if getattr(req, "optimizer_config", None) else (
        manifest.get("optimizer_config") or {"type": "adamw"})
    rec = await _new_run(request, req.session_id, req.model_seq_id, base, lora,
                         {"optimizer_config": opt, "user_metadata": req.user_metadata or {}})
    rid = request_id_for(rec["model_id"], 0)
    data = payloads.LoadWeights(model_id=rec["model_id"], base_model=base, lora_config=lora, optimizer_config=opt,
                                path=str(ckpt), optimizer=req.optimizer, create=True, seq_id=0).to_data()
    await g.submit("load_weights", rid, rec["model_id"], data, model=rec, future_meta={"owner": who})
    return {"request_id": rid, "model_id": rec["model_id"]}


@router.post("/save_weights_external")
async def save_weights_external(request: Request) -> dict:
    """``TrainingClient.save_weights_external``: the PEFT adapter as an ``external_weights``
    checkpoint (``tinker://<run>/external_weights/<name>``), downloadable through
    ``RestClient.get_external_weights_urls``. Future result ``{path, size_bytes}``.

    Raises:
        NotSupported: ``age_encryption_recipients`` given (checkpoints are stored unencrypted).
    """
    req = await _parse_training(request, wire.SaveWeightsExternalRequest)
    if req.age_encryption_recipients:
        from openrl.errors import NotSupported

        await _skip_owned(request, req.model_id, req.seq_id)
        raise NotSupported("age_encryption_recipients", "age-encrypted external weights; omit the recipients "
                           "(the download URLs are signed and expire instead)")
    try:
        path = _checkpoint_path(req.model_id, "external_weights", req.path or f"external-{req.seq_id}")
    except UserError:
        await _skip_owned(request, req.model_id, req.seq_id)
        raise
    return await _simple(request, "save_weights_external", req,
                         {"path": path, "ttl_seconds": req.ttl_seconds, "owner": owner(request)})


@router.post("/unload_model")
async def unload_model(request: Request) -> dict:
    req = await parse(request, wire.UnloadModelRequest)
    g = gw(request)
    rec = await g.model(req.model_id, owner(request))
    rid = f"{req.model_id}:unload"
    await g.submit("unload_model", rid, req.model_id, payloads.UnloadModel(model_id=req.model_id, seq_id=None).to_data(),
                   model=rec,
                   future_meta={"owner": rec["owner"]})
    return {"request_id": rid, "model_id": req.model_id}


async def _owned_manifest(g, ckpt: TinkerPath, who: str, field_name: str = "path") -> dict:
    """The manifest of a checkpoint the caller may read (own or published), else NotFound
    naming ``field_name`` (also for another key's private checkpoint)."""
    import asyncio

    from openrl.errors import NotFound

    m = await asyncio.to_thread(g.storage.manifest, ckpt)
    if m is None or (m.get("owner") != who and not m.get("public")):
        raise NotFound(field_name, f"no checkpoint at {ckpt}")
    return m
