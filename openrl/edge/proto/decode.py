"""Decoding a ``ForwardBackwardRequest`` body into :class:`~openrl.edge.proto.types.FwdBwdRequest`
(dense numpy ``loss_fn_inputs``), and peeking the run and seq_id of a body too large or broken to decode."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from openrl.edge.proto.compress import MAX_DECOMPRESSED_BYTES, decompress, decompress_head
from openrl.edge.proto.schema import DType, ForwardBackwardRequest
from openrl.edge.proto.spans import decode_spans
from openrl.edge.proto.types import FwdBwdDatum, FwdBwdRequest
from openrl.errors import UserError

#: Upper bound on the dense element count of one decoded tensor (guards CSR
#: tensors whose ``shape`` would densify into gigabytes).
MAX_TENSOR_ELEMENTS = 1 << 27

#: The ``loss_fn_inputs`` keys this server knows, with their kind (the SDK's ``Datum`` dtype
#: table, ``tinker/types/datum.py`` ``_KEY_TO_TYPE``): "int" keys must arrive as an integer
#: DType, "float" keys are converted to float32 when sent as ints. Every loss accepts every
#: one of them (validated, and ignored by a loss that does not read it); a key outside this
#: table is refused (:func:`functions.gateway.fwdbwd.validate_datums`, docs/compatibility.md).
LOSS_FN_INPUT_KINDS: dict[str, str] = {
    "target_tokens": "int",
    "weights": "float",
    "advantages": "float",
    "logprobs": "float",
    "clip_low_threshold": "float",
    "clip_high_threshold": "float",
    "sequence_ratio_mask": "float",
}
# Keys whose leading dimension is the token axis and must equal len(tokens).
_PER_TOKEN_KEYS = ("target_tokens", "weights", "advantages", "logprobs")

# wire DType -> (little-endian source dtype, decoded numpy dtype)
_WIRE_DTYPES: dict[int, tuple[str, type]] = {
    DType.FLOAT32: ("<f4", np.float32),
    DType.INT64: ("<i8", np.int64),
    DType.INT32: ("<i4", np.int64),
    DType.BFLOAT16: ("<u2", np.float32),
}


def _frombuffer(buf: bytes, le_dtype: str, fname: str, what: str) -> np.ndarray:
    itemsize = np.dtype(le_dtype).itemsize
    if len(buf) % itemsize:
        raise UserError(fname, f"{what} has {len(buf)} bytes, not a multiple of {itemsize}")
    return np.frombuffer(buf, dtype=le_dtype)


def csr_to_dense(
    values: np.ndarray,
    crow_indices: np.ndarray,
    col_indices: np.ndarray,
    shape: Sequence[int],
    pad_value: float = 0,
    *,
    field_name: str = "tensor",
) -> np.ndarray:
    """Densify a 2-D CSR tensor.

    Args:
        values: ``[nnz]`` listed values (any numeric dtype; the result keeps it).
        crow_indices: ``[rows + 1]`` int row pointers, starting at 0, non-decreasing,
            ending at ``nnz``.
        col_indices: ``[nnz]`` int column of each value, in ``[0, cols)``.
        shape: the dense ``[rows, cols]``.
        pad_value: the value of every unlisted cell.
        field_name: named in errors.

    Returns:
        A new writable ``[rows, cols]`` array of ``values.dtype``.

    Raises:
        UserError: inconsistent indices, a shape that is not 2-D, or more than
            ``MAX_TENSOR_ELEMENTS`` cells.
    """
    if len(shape) != 2:
        raise UserError(field_name, f"a sparse CSR tensor must be 2-D, got shape {list(shape)}")
    rows, cols = int(shape[0]), int(shape[1])
    if rows < 0 or cols < 0:
        raise UserError(field_name, f"negative dimension in shape {list(shape)}")
    if rows * cols > MAX_TENSOR_ELEMENTS:
        raise UserError(field_name, f"shape {list(shape)} exceeds {MAX_TENSOR_ELEMENTS} elements")
    crow = np.asarray(crow_indices, dtype=np.int64)
    col = np.asarray(col_indices, dtype=np.int64)
    nnz = len(values)
    if len(crow) != rows + 1:
        raise UserError(field_name, f"crow_indices has {len(crow)} entries, expected rows+1 = {rows + 1}")
    if crow[0] != 0 or crow[-1] != nnz or np.any(np.diff(crow) < 0):
        raise UserError(field_name, f"crow_indices must rise from 0 to nnz={nnz}")
    if len(col) != nnz:
        raise UserError(field_name, f"col_indices has {len(col)} entries but there are {nnz} values")
    if nnz and (col.min() < 0 or col.max() >= cols):
        raise UserError(field_name, f"col_indices out of range [0, {cols})")
    out = np.full((rows, cols), pad_value, dtype=values.dtype)
    row_idx = np.repeat(np.arange(rows, dtype=np.int64), np.diff(crow))
    out[row_idx, col] = values
    return out


def _decode_tensor(t: Any, fname: str, key: str) -> np.ndarray:
    if t.dtype not in _WIRE_DTYPES:
        raise UserError(fname, f"unsupported dtype {t.dtype} (expected FLOAT32 or INT64)")
    le_dtype, out_dtype = _WIRE_DTYPES[t.dtype]
    kind = LOSS_FN_INPUT_KINDS.get(key)
    if kind == "int" and out_dtype is not np.int64:
        raise UserError(fname, "must be an int64 tensor (token ids), got float32")
    if kind == "float":
        out_dtype = np.float32
    shape = [int(s) for s in t.shape]
    if any(s < 0 for s in shape):
        raise UserError(fname, f"negative dimension in shape {shape}")
    which = t.WhichOneof("encoding")
    if which == "sparse_csr":
        csr = t.sparse_csr
        values = _frombuffer(csr.values, le_dtype, fname, "sparse_csr.values")
        crow = _frombuffer(csr.crow_indices, "<i8", fname, "sparse_csr.crow_indices")
        col = _frombuffer(csr.col_indices, "<i8", fname, "sparse_csr.col_indices")
        values = _widen(values, t.dtype).astype(out_dtype, copy=False)
        return csr_to_dense(values, crow, col, shape, 0, field_name=fname)
    flat = _frombuffer(t.dense, le_dtype, fname, "dense data")
    if not shape:
        shape = [len(flat)]
    n = math.prod(shape)
    if n != len(flat):
        raise UserError(fname, f"data has {len(flat)} elements but shape {shape} needs {n}")
    return _widen(flat, t.dtype).astype(out_dtype, copy=True).reshape(shape)


def _widen(arr: np.ndarray, dtype: int) -> np.ndarray:
    if dtype == DType.BFLOAT16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


HEAD_BYTES = 4096  # how much of a forward_backward body :func:`peek_run_and_seq` needs at most


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    """Decode a base-128 varint at ``buf[i:]``; returns (value, next index).

    Raises:
        IndexError: the buffer ends inside the varint.
    """
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise IndexError("varint longer than 64 bits")


def peek_run_and_seq(head: bytes, content_encoding: str | None = None) -> tuple[str | None, int | None]:
    """``(model_id, seq_id)`` from the first bytes of a ``ForwardBackwardRequest`` body.

    For a body the gateway will not decode (over the size cap, or broken datums) it still
    learns which seq_id of which run to skip. The SDK's protobuf encoder writes fields in
    field-number order, so ``model_id`` (1) and ``seq_id`` (2) come before the datums (3);
    the scan reads top-level fields, stops at the first field it cannot finish and never
    raises. A zstd body (``content_encoding="zstd"``) is decompressed as far as ``head`` goes.

    Args:
        head: the body's first bytes (:data:`HEAD_BYTES` is enough), possibly truncated.
        content_encoding: the request's ``Content-Encoding``.

    Returns:
        The values found; None for a field that is absent from ``head``.
    """
    head = decompress_head(head, content_encoding)
    if head is None:
        return None, None
    model_id: str | None = None
    seq_id: int | None = None
    i = 0
    try:
        while i < len(head) and (model_id is None or seq_id is None):
            key, i = _varint(head, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, i = _varint(head, i)
                if number == 2:
                    seq_id = value
            elif wire == 2:
                n, i = _varint(head, i)
                if i + n > len(head):
                    break
                if number == 1:
                    model_id = head[i:i + n].decode("utf-8")
                i += n
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            else:
                break
    except (IndexError, UnicodeDecodeError):
        pass
    return model_id, seq_id


def _field_path(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def refuse_unknown_fields(msg: Any, path: str = "") -> None:
    """Refuse a message that carries a field its schema does not have, anywhere inside it
    (invariant 12: protobuf keeps unknown fields aside and the decoder would never read them).

    Fields are named as the decoder names them (``data[0].model_input.chunks[1]``,
    ``data[0].loss_fn_inputs.weights``); the unknown one by its number, ``<path>.#<number>``.

    Raises:
        UserError: naming the first unknown field found.
    """
    unknown = list(UnknownFieldSet(msg))
    if unknown:
        known = ", ".join(f"{f.name}={f.number}" for f in msg.DESCRIPTOR.fields)
        f = unknown[0]
        raise UserError(_field_path(path, f"#{f.field_number}"),
                        f"unknown field number {f.field_number} of {msg.DESCRIPTOR.name} (its fields: {known})")
    for fd, value in msg.ListFields():
        if fd.message_type is None:
            continue
        name = _field_path(path, "model_input.chunks" if fd.full_name.endswith("Datum.model_input") else fd.name)
        if fd.message_type.GetOptions().map_entry:
            if fd.message_type.fields_by_name["value"].message_type is not None:
                for key, sub in value.items():
                    refuse_unknown_fields(sub, f"{name}.{key}")
        elif fd.is_repeated:
            for i, sub in enumerate(value):
                refuse_unknown_fields(sub, f"{name}[{i}]")
        else:
            refuse_unknown_fields(value, name)


def decode_forward_backward_request(
    body: bytes, *, content_encoding: str | None = None, require_seq_id: bool = True
) -> FwdBwdRequest:
    """Decode a ``/forward_backward`` protobuf body.

    Args:
        body: the raw HTTP body (bytes), a serialized ``tinker_public.ForwardBackwardRequest``.
        content_encoding: the ``Content-Encoding`` header; ``"zstd"`` bodies are
            decompressed (at most ``MAX_DECOMPRESSED_BYTES``), ``None``/``"identity"``
            taken as is.
        require_seq_id: False: a body without ``seq_id`` (0 on the proto3 wire, which the SDK
            never sends: its seq_ids start at 1) decodes with ``seq_id == 0``, for the gateway
            to number (the SDK's ``ForwardBackwardRequest.seq_id`` is optional).

    Returns:
        A :class:`FwdBwdRequest`; see :class:`FwdBwdDatum` for array dtypes and shapes.
        Provenance spans are decoded into ``FwdBwdDatum.model_input_spans`` /
        ``loss_fn_input_spans`` (:func:`openrl.edge.proto.spans.decode_spans`); their tiling is
        checked by :func:`openrl.edge.proto.spans.check_spans`, not here.

    Raises:
        UserError: with the offending field named — ``Content-Encoding``; ``body``
            (bad zstd, unparseable protobuf); a field number the schema does not have, anywhere
            (``data[0].#9``, :func:`refuse_unknown_fields`); ``model_id`` (empty); ``seq_id`` (< 1);
            ``loss_fn`` (empty); ``loss_fn_config.<k>`` (no value);
            ``data[i].model_input.chunks[j]`` (empty, image or dmel chunk; token bytes
            not a multiple of 4; negative ids); ``data[i].loss_fn_inputs.<key>``
            (unknown dtype, float ``target_tokens``, byte counts, element count not
            matching ``shape``, bad CSR indices, leading dimension not ``len(tokens)``);
            ``data[i].model_input_spans[j]`` / ``data[i].loss_fn_input_spans[j]`` (no span
            arm, empty ``sequence_id``, negative ``offset`` / ``length``).
    """
    raw = decompress(bytes(body), content_encoding, limit=MAX_DECOMPRESSED_BYTES)
    if len(raw) > MAX_DECOMPRESSED_BYTES:
        raise UserError("body", f"decompressed body exceeds {MAX_DECOMPRESSED_BYTES} bytes")
    msg = ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise UserError("body", f"malformed ForwardBackwardRequest protobuf: {exc}") from None
    refuse_unknown_fields(msg)
    if not msg.model_id:
        raise UserError("model_id", "required")
    if msg.seq_id < (1 if require_seq_id else 0):
        raise UserError("seq_id", f"must be >= 1, got {msg.seq_id}")
    if not msg.loss_fn:
        raise UserError("loss_fn", "required")

    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        which = v.WhichOneof("value")
        if which == "number":
            config[k] = float(v.number)
        elif which == "text":
            config[k] = v.text
        else:
            raise UserError(f"loss_fn_config.{k}", "value has neither number nor text")

    data: list[FwdBwdDatum] = []
    for i, d in enumerate(msg.data):
        parts: list[np.ndarray] = []
        for j, chunk in enumerate(d.model_input):
            cname = f"data[{i}].model_input.chunks[{j}]"
            which = chunk.WhichOneof("chunk")
            if which == "encoded_text":
                toks = _frombuffer(chunk.encoded_text.tokens, "<i4", cname, "tokens")
                if toks.size and toks.min() < 0:
                    raise UserError(cname, "token ids must be >= 0")
                parts.append(toks)
            elif which == "image":
                raise UserError(cname, "image chunks are not supported by this server")
            elif which == "dmel":
                raise UserError(cname, "dmel (audio) chunks are not supported by this server")
            else:
                raise UserError(cname, "empty chunk")
        tokens = np.concatenate(parts).astype(np.int64).tolist() if parts else []
        inputs: dict[str, np.ndarray] = {}
        for key, tensor in d.loss_fn_inputs.items():
            fname = f"data[{i}].loss_fn_inputs.{key}"
            arr = _decode_tensor(tensor, fname, key)
            if key in _PER_TOKEN_KEYS and (arr.ndim == 0 or arr.shape[0] != len(tokens)):
                raise UserError(
                    fname,
                    f"shape {list(arr.shape)} does not match the {len(tokens)} input tokens",
                )
            inputs[key] = arr
        data.append(FwdBwdDatum(tokens=tokens, loss_fn_inputs=inputs,
                                model_input_spans=decode_spans(d.model_input_spans, f"data[{i}].model_input_spans"),
                                loss_fn_input_spans=decode_spans(d.loss_fn_input_spans,
                                                                 f"data[{i}].loss_fn_input_spans")))

    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=bool(msg.forward_only),
        data=data,
    )
