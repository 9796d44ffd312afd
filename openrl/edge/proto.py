"""The ``tinker_public`` protobuf messages and the codecs the server needs.

The message classes are built at import time from a ``FileDescriptorProto``
written out below (package ``tinker_public``, proto3), registered in a private
``DescriptorPool`` so this module can live next to the SDK's own generated
module in one process. Field names, numbers, types and proto3 ``optional``
presence match the wire of the ``tinker`` 0.38.0 SDK exactly
(``tests/test_proto.py`` checks this against the SDK's descriptor).

Wire conventions: every numeric array travels as raw little-endian bytes;
``EncodedTextChunk.tokens`` is int32, CSR indices are int64, tensor values use
the tensor's ``DType``.

Codecs (plain Python / numpy on our side):

* :func:`decode_forward_backward_request` — protobuf body (optionally zstd) →
  :class:`FwdBwdRequest` with dense numpy ``loss_fn_inputs``.
* :func:`encode_forward_backward_output` — per-datum arrays + metrics →
  ``ForwardBackwardOutput`` bytes.
* :func:`encode_sample_response` — sampled sequences (+ prompt logprobs) →
  ``SampleResponse`` bytes.
* :func:`encode_forward_backward_request` — the inverse of the decoder, for tests
  and tools (the SDK does its own encoding).
"""

from __future__ import annotations

import enum
import io
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from openrl.errors import UserError

__all__ = [
    "DType",
    "StopReason",
    "FwdBwdDatum",
    "FwdBwdRequest",
    "SampledSeq",
    "decode_forward_backward_request",
    "peek_run_and_seq",
    "HEAD_BYTES",
    "encode_forward_backward_output",
    "encode_sample_response",
    "encode_forward_backward_request",
    "csr_to_dense",
    "FILE_DESCRIPTOR",
    "MAX_TENSOR_ELEMENTS",
    "MAX_DECOMPRESSED_BYTES",
]

# --------------------------------------------------------------------------------------
# Descriptor
# --------------------------------------------------------------------------------------

PACKAGE = "tinker_public"
FILE_NAME = "tinker_public.proto"

_FD = descriptor_pb2.FieldDescriptorProto
_SCALAR = {
    "bytes": _FD.TYPE_BYTES,
    "string": _FD.TYPE_STRING,
    "bool": _FD.TYPE_BOOL,
    "double": _FD.TYPE_DOUBLE,
    "float": _FD.TYPE_FLOAT,
    "int32": _FD.TYPE_INT32,
    "int64": _FD.TYPE_INT64,
    "uint32": _FD.TYPE_UINT32,
    "uint64": _FD.TYPE_UINT64,
}
_ENUMS = {"DType", "StopReason"}

# Field spec: (name, number, type, modifiers). ``type`` is a scalar name from _SCALAR,
# an enum / message name of this package, or ("map", key_scalar, value_type).
# Modifiers: "repeated", "optional" (proto3 optional), or "oneof:<name>".
_MESSAGES: list[tuple[str, list[tuple]]] = [
    ("SampleResponse", [
        ("sequences", 1, "SampledSequence", "repeated"),
        ("prompt_logprobs", 2, "bytes", "optional"),
        ("topk_prompt_logprobs", 3, "TopkLogprobs", "optional"),
        ("prompt_cache_hit_tokens", 4, "int32", ""),
        ("target_prompt_logprobs", 5, "Tensor", "optional"),
        ("prompt_alt_tokens", 6, "PromptAltTokens", "optional"),
    ]),
    ("PromptAltTokens", [
        ("tokens", 1, "Tensor", ""),
        ("logprobs", 2, "Tensor", ""),
    ]),
    ("SampledSequence", [
        ("stop_reason", 1, "StopReason", ""),
        ("tokens", 2, "bytes", ""),
        ("logprobs", 3, "bytes", "optional"),
        ("topk_sampled_logprobs", 4, "TopkLogprobs", "optional"),
    ]),
    ("TopkLogprobs", [
        ("token_ids", 1, "bytes", ""),
        ("logprobs", 2, "bytes", ""),
        ("k", 3, "uint32", ""),
        ("length", 4, "uint32", ""),
    ]),
    ("SparseCsr", [
        ("values", 1, "bytes", ""),
        ("crow_indices", 2, "bytes", ""),
        ("col_indices", 3, "bytes", ""),
    ]),
    ("Tensor", [
        ("dense", 1, "bytes", "oneof:encoding"),
        ("sparse_csr", 2, "SparseCsr", "oneof:encoding"),
        ("dtype", 3, "DType", ""),
        ("shape", 4, "int64", "repeated"),
    ]),
    ("BatchedTensor", [
        ("data", 1, "bytes", ""),
        ("offsets", 2, "bytes", ""),
        ("dtype", 3, "DType", ""),
        ("trailing_shape", 4, "int64", "repeated"),
    ]),
    ("ArrayRecord", [
        ("type_tag", 1, "string", ""),
        ("fields", 2, ("map", "string", "BatchedTensor"), ""),
        ("num_datums", 3, "int64", ""),
    ]),
    ("ForwardBackwardOutput", [
        ("loss_fn_output_type", 1, "string", ""),
        ("loss_fn_outputs", 2, "ArrayRecord", "repeated"),
        ("metrics", 3, ("map", "string", "double"), ""),
    ]),
    ("ForwardBackwardRequest", [
        ("model_id", 1, "string", ""),
        ("seq_id", 2, "int32", ""),
        ("data", 3, "Datum", "repeated"),
        ("loss_fn", 4, "string", ""),
        ("loss_fn_config", 5, ("map", "string", "double"), ""),
        ("forward_only", 6, "bool", ""),
        ("loss_fn_config_v2", 7, ("map", "string", "LossConfigValue"), ""),
    ]),
    ("LossConfigValue", [
        ("number", 1, "double", "oneof:value"),
        ("text", 2, "string", "oneof:value"),
    ]),
    ("Datum", [
        ("model_input", 1, "Chunk", "repeated"),
        ("loss_fn_inputs", 2, ("map", "string", "Tensor"), ""),
        ("model_input_spans", 3, "ProvenanceSpan", "repeated"),
        ("loss_fn_input_spans", 4, "ProvenanceSpan", "repeated"),
    ]),
    ("ProvenanceSpan", [
        ("prompt_tokens", 1, "PromptProvenanceSpan", "oneof:span"),
        ("sampled_tokens", 2, "SampledProvenanceSpan", "oneof:span"),
    ]),
    ("PromptProvenanceSpan", [
        ("sequence_id", 1, "string", ""),
        ("offset", 2, "int64", ""),
        ("length", 3, "int64", ""),
    ]),
    ("SampledProvenanceSpan", [
        ("sequence_id", 1, "string", ""),
        ("offset", 2, "int64", ""),
        ("length", 3, "int64", ""),
    ]),
    ("Chunk", [
        ("encoded_text", 1, "EncodedTextChunk", "oneof:chunk"),
        ("image", 2, "ImageChunk", "oneof:chunk"),
        ("dmel", 3, "DmelChunk", "oneof:chunk"),
    ]),
    ("EncodedTextChunk", [
        ("tokens", 1, "bytes", ""),
    ]),
    ("ImageChunk", [
        ("data", 1, "bytes", ""),
        ("format", 2, "string", ""),
        ("expected_tokens", 3, "int32", "optional"),
        ("override_dimensions", 4, "ImageDimensions", "optional"),
    ]),
    ("ImageDimensions", [
        ("width", 1, "uint32", ""),
        ("height", 2, "uint32", ""),
    ]),
    ("DmelChunk", [
        ("dmel", 1, "bytes", ""),
    ]),
    ("SamplingParams", [
        ("max_tokens", 1, "int32", "optional"),
        ("seed", 2, "uint64", "optional"),
        ("temperature", 3, "float", "optional"),
        ("top_k", 4, "int32", "optional"),
        ("top_p", 5, "float", "optional"),
        ("stop_strs", 6, "StopStrings", "oneof:stop"),
        ("stop_tokens", 7, "StopTokens", "oneof:stop"),
    ]),
    ("StopStrings", [
        ("values", 1, "string", "repeated"),
    ]),
    ("StopTokens", [
        ("values", 1, "int32", "repeated"),
    ]),
]

_ENUM_VALUES: list[tuple[str, list[tuple[str, int]]]] = [
    ("StopReason", [("STOP_REASON_STOP", 0), ("STOP_REASON_LENGTH", 1)]),
    ("DType", [
        ("DTYPE_UNSPECIFIED", 0),
        ("DTYPE_FLOAT32", 1),
        ("DTYPE_INT64", 2),
        ("DTYPE_INT32", 3),
        ("DTYPE_BFLOAT16", 4),
    ]),
]


def _set_type(f: descriptor_pb2.FieldDescriptorProto, type_: str) -> None:
    if type_ in _SCALAR:
        f.type = _SCALAR[type_]
    elif type_ in _ENUMS:
        f.type = _FD.TYPE_ENUM
        f.type_name = f".{PACKAGE}.{type_}"
    else:
        f.type = _FD.TYPE_MESSAGE
        f.type_name = f".{PACKAGE}.{type_}"


def _build_file() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE, syntax="proto3")
    for msg_name, fields in _MESSAGES:
        m = fdp.message_type.add(name=msg_name)
        real_oneofs: list[str] = []
        for _, _, _, mod in fields:
            if mod.startswith("oneof:") and mod[6:] not in real_oneofs:
                real_oneofs.append(mod[6:])
        for o in real_oneofs:
            m.oneof_decl.add(name=o)
        for name, number, type_, mod in fields:
            f = m.field.add(name=name, number=number)
            if isinstance(type_, tuple):  # map<key, value>
                _, key_t, val_t = type_
                entry_name = "".join(p[:1].upper() + p[1:] for p in name.split("_")) + "Entry"
                entry = m.nested_type.add(name=entry_name)
                entry.options.map_entry = True
                k = entry.field.add(name="key", number=1, label=_FD.LABEL_OPTIONAL)
                _set_type(k, key_t)
                v = entry.field.add(name="value", number=2, label=_FD.LABEL_OPTIONAL)
                _set_type(v, val_t)
                f.label = _FD.LABEL_REPEATED
                f.type = _FD.TYPE_MESSAGE
                f.type_name = f".{PACKAGE}.{msg_name}.{entry_name}"
                continue
            _set_type(f, type_)
            f.label = _FD.LABEL_REPEATED if mod == "repeated" else _FD.LABEL_OPTIONAL
            if mod.startswith("oneof:"):
                f.oneof_index = real_oneofs.index(mod[6:])
            elif mod == "optional":  # proto3 optional: a synthetic oneof "_<name>"
                f.proto3_optional = True
                f.oneof_index = len(m.oneof_decl)
                m.oneof_decl.add(name=f"_{name}")
    for enum_name, values in _ENUM_VALUES:
        e = fdp.enum_type.add(name=enum_name)
        for vname, vnum in values:
            e.value.add(name=vname, number=vnum)
    return fdp


FILE_DESCRIPTOR_PROTO = _build_file()
_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(FILE_DESCRIPTOR_PROTO)
FILE_DESCRIPTOR = _POOL.FindFileByName(FILE_NAME)


def _cls(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


SampleResponse = _cls("SampleResponse")
PromptAltTokens = _cls("PromptAltTokens")
SampledSequence = _cls("SampledSequence")
TopkLogprobs = _cls("TopkLogprobs")
SparseCsr = _cls("SparseCsr")
Tensor = _cls("Tensor")
BatchedTensor = _cls("BatchedTensor")
ArrayRecord = _cls("ArrayRecord")
ForwardBackwardOutput = _cls("ForwardBackwardOutput")
ForwardBackwardRequest = _cls("ForwardBackwardRequest")
LossConfigValue = _cls("LossConfigValue")
Datum = _cls("Datum")
ProvenanceSpan = _cls("ProvenanceSpan")
PromptProvenanceSpan = _cls("PromptProvenanceSpan")
SampledProvenanceSpan = _cls("SampledProvenanceSpan")
Chunk = _cls("Chunk")
EncodedTextChunk = _cls("EncodedTextChunk")
ImageChunk = _cls("ImageChunk")
ImageDimensions = _cls("ImageDimensions")
DmelChunk = _cls("DmelChunk")
SamplingParams = _cls("SamplingParams")
StopStrings = _cls("StopStrings")
StopTokens = _cls("StopTokens")


class DType(enum.IntEnum):
    """``tinker_public.DType`` (enum values as on the wire)."""

    UNSPECIFIED = 0
    FLOAT32 = 1
    INT64 = 2
    INT32 = 3
    BFLOAT16 = 4


class StopReason(enum.IntEnum):
    """``tinker_public.StopReason``: STOP is the SDK's ``"stop"``, LENGTH its ``"length"``."""

    STOP = 0
    LENGTH = 1


_STOP_REASON_BY_NAME = {"stop": StopReason.STOP, "length": StopReason.LENGTH}

# --------------------------------------------------------------------------------------
# Decoding ForwardBackwardRequest
# --------------------------------------------------------------------------------------

#: Upper bound on the dense element count of one decoded tensor (guards CSR
#: tensors whose ``shape`` would densify into gigabytes).
MAX_TENSOR_ELEMENTS = 1 << 27
#: Upper bound, in bytes, on a zstd-decompressed request body.
MAX_DECOMPRESSED_BYTES = 1 << 30

# loss_fn_inputs keys with a fixed dtype (the SDK's Datum table): "int" keys must
# arrive as an integer DType, "float" keys are converted to float32 when sent as ints.
_KEY_KIND = {
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


@dataclass
class FwdBwdDatum:
    """One decoded training example.

    Attributes:
        tokens: the model input, all ``encoded_text`` chunks concatenated (token ids ≥ 0).
        loss_fn_inputs: name → dense, writable numpy array. ``int64`` for integer
            wire dtypes (``target_tokens`` always), ``float32`` otherwise. Shape is
            the tensor's ``shape`` (``[len(data)]`` when the SDK sent none); for
            ``target_tokens``/``weights``/``advantages``/``logprobs`` the leading
            dimension equals ``len(tokens)``. CSR tensors are densified with 0.
    """

    tokens: list[int]
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class FwdBwdRequest:
    """A decoded ``ForwardBackwardRequest`` (``/forward_backward`` and ``forward``).

    Attributes:
        model_id: the training run id (non-empty).
        seq_id: the per-model sequence number (≥ 1).
        loss_fn: loss function name as sent (e.g. ``"cross_entropy"``); not checked here.
        loss_fn_config: the legacy numeric map merged with ``loss_fn_config_v2``
            (v2 wins); values are ``float`` or ``str``.
        forward_only: True for ``forward()`` (no gradients wanted).
        data: the examples, in request order.
    """

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[FwdBwdDatum]


def _decompress(body: bytes, content_encoding: str | None) -> bytes:
    enc = (content_encoding or "").strip().lower()
    if enc in ("", "identity"):
        return body
    if enc != "zstd":
        raise UserError("Content-Encoding", f"unsupported encoding {content_encoding!r}; use zstd")
    import zstandard

    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body))
        out = reader.read(MAX_DECOMPRESSED_BYTES + 1)
        # read() may return less than asked before the end; keep reading until EOF.
        parts = [out]
        total = len(out)
        while out and total <= MAX_DECOMPRESSED_BYTES:
            out = reader.read(MAX_DECOMPRESSED_BYTES + 1 - total)
            parts.append(out)
            total += len(out)
    except zstandard.ZstdError as exc:
        raise UserError("body", f"invalid zstd data: {exc}") from None
    if total > MAX_DECOMPRESSED_BYTES:
        raise UserError("body", f"decompressed body exceeds {MAX_DECOMPRESSED_BYTES} bytes")
    return b"".join(parts)


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
    kind = _KEY_KIND.get(key)
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
    if (content_encoding or "").strip().lower() == "zstd":
        try:
            import zstandard

            head = zstandard.ZstdDecompressor().decompressobj().decompress(head)
        except Exception:  # noqa: BLE001 - not zstd at all
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


def decode_forward_backward_request(
    body: bytes, *, content_encoding: str | None = None
) -> FwdBwdRequest:
    """Decode a ``/forward_backward`` protobuf body.

    Args:
        body: the raw HTTP body (bytes), a serialized ``tinker_public.ForwardBackwardRequest``.
        content_encoding: the ``Content-Encoding`` header; ``"zstd"`` bodies are
            decompressed (at most ``MAX_DECOMPRESSED_BYTES``), ``None``/``"identity"``
            taken as is.

    Returns:
        A :class:`FwdBwdRequest`; see :class:`FwdBwdDatum` for array dtypes and shapes.
        Provenance spans are not returned.

    Raises:
        UserError: with the offending field named — ``Content-Encoding``; ``body``
            (bad zstd, unparseable protobuf); ``model_id`` (empty); ``seq_id`` (< 1);
            ``loss_fn`` (empty); ``loss_fn_config.<k>`` (no value);
            ``data[i].model_input.chunks[j]`` (empty, image or dmel chunk; token bytes
            not a multiple of 4; negative ids); ``data[i].loss_fn_inputs.<key>``
            (unknown dtype, float ``target_tokens``, byte counts, element count not
            matching ``shape``, bad CSR indices, leading dimension not ``len(tokens)``).
    """
    raw = _decompress(bytes(body), content_encoding)
    msg = ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise UserError("body", f"malformed ForwardBackwardRequest protobuf: {exc}") from None
    if not msg.model_id:
        raise UserError("model_id", "required")
    if msg.seq_id < 1:
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
        data.append(FwdBwdDatum(tokens=tokens, loss_fn_inputs=inputs))

    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=bool(msg.forward_only),
        data=data,
    )


# --------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------


def _wire_array(arr: Any) -> tuple[np.ndarray, DType]:
    """numpy-ify; floating/bool → float32, integer → int64 (both little-endian)."""
    a = np.asarray(arr)
    if a.dtype.kind in "iu":
        return a.astype("<i8", copy=False), DType.INT64
    if a.dtype.kind in "fb":
        return a.astype("<f4", copy=False), DType.FLOAT32
    raise ValueError(f"cannot encode array of dtype {a.dtype}")


def encode_forward_backward_output(
    loss_fn_outputs: Sequence[Mapping[str, Any]],
    metrics: Mapping[str, float],
    loss_fn_output_type: str = "ArrayRecord",
) -> bytes:
    """Serialize a ``tinker_public.ForwardBackwardOutput``.

    Args:
        loss_fn_outputs: one dict per datum, in request order; every dict has the same
            keys. Each value is array-like with shape ``[T_i, *trailing]`` (a 0-d value
            is sent as ``[1]``); ``trailing`` must be the same for all datums of a key.
            Floating (and bool) arrays go out as FLOAT32, integer arrays as INT64. The
            SDK expects at least ``logprobs`` (float32, shape of ``target_tokens``).
        metrics: ``"name:reduction"`` → float, e.g. ``{"loss:sum": 1.5}``; the SDK merges
            chunk metrics by the reduction (mean|sum|min|max|slack|hash2|unique).
        loss_fn_output_type: class tag for the record; the SDK shows the part after the
            last ``:``.

    Returns:
        The serialized message (bytes): one ``ArrayRecord`` with ``num_datums`` set and
        one ``BatchedTensor`` per key (all datums' data concatenated, ``num_datums + 1``
        int64 byte offsets).

    Raises:
        ValueError: datums with different keys, mismatched trailing shapes, a non-numeric
            array, or a metric name without exactly one ``:`` (server bugs, not user errors).
    """
    for name in metrics:
        if name.count(":") != 1:
            raise ValueError(f"metric name {name!r} must have the form 'name:reduction'")
    out = ForwardBackwardOutput(loss_fn_output_type=loss_fn_output_type)
    for name, value in metrics.items():
        out.metrics[name] = float(value)
    rec = out.loss_fn_outputs.add(type_tag=loss_fn_output_type, num_datums=len(loss_fn_outputs))
    if loss_fn_outputs:
        keys = list(loss_fn_outputs[0].keys())
        for i, d in enumerate(loss_fn_outputs):
            if set(d.keys()) != set(keys):
                raise ValueError(f"loss_fn_outputs[{i}] keys {sorted(d)} differ from {sorted(keys)}")
        for key in keys:
            arrays = []
            dtype = None
            trailing: tuple[int, ...] | None = None
            for i, d in enumerate(loss_fn_outputs):
                a, dt = _wire_array(d[key])
                if a.ndim == 0:
                    a = a.reshape(1)
                if dtype is None:
                    dtype, trailing = dt, a.shape[1:]
                elif dt != dtype:
                    a = a.astype("<f4" if dtype == DType.FLOAT32 else "<i8")
                if a.shape[1:] != trailing:
                    raise ValueError(
                        f"loss_fn_outputs[{i}][{key!r}] trailing shape {a.shape[1:]} != {trailing}"
                    )
                arrays.append(np.ascontiguousarray(a))
            sizes = np.array([0] + [a.nbytes for a in arrays], dtype="<i8")
            bt = rec.fields[key]
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = np.cumsum(sizes).astype("<i8").tobytes()
            bt.dtype = int(dtype)
            bt.trailing_shape.extend(int(s) for s in trailing)
    return out.SerializeToString()


@dataclass
class SampledSeq:
    """One sampled completion, as handed to :func:`encode_sample_response`.

    Attributes:
        tokens: generated token ids (int32 on the wire), stop token included if emitted.
        logprobs: per generated token logprob (float32), same length as ``tokens``, or None.
        stop_reason: ``"stop"`` (stop sequence / EOS) or ``"length"`` (max_tokens).
        topk: ``(ids [N, K] int, logprobs [N, K] float)`` top-k per generated token, or
            None. Empty cells: id 0 with logprob -99999.0.
    """

    tokens: Sequence[int]
    logprobs: Sequence[float] | None = None
    stop_reason: Literal["stop", "length"] = "stop"
    topk: tuple[Any, Any] | None = None


def _fill_topk(msg: Any, topk: tuple[Any, Any]) -> None:
    ids = np.asarray(topk[0], dtype="<i4")
    lps = np.asarray(topk[1], dtype="<f4")
    if ids.ndim != 2 or ids.shape != lps.shape:
        raise ValueError(f"top-k ids {ids.shape} and logprobs {lps.shape} must both be [N, K]")
    msg.token_ids = np.ascontiguousarray(ids).tobytes()
    msg.logprobs = np.ascontiguousarray(lps).tobytes()
    msg.length, msg.k = int(ids.shape[0]), int(ids.shape[1])


def _fill_dense_tensor(msg: Any, arr: np.ndarray, dtype: DType) -> None:
    le = {DType.FLOAT32: "<f4", DType.INT64: "<i8", DType.INT32: "<i4"}[dtype]
    a = np.ascontiguousarray(np.asarray(arr, dtype=le))
    msg.dense = a.tobytes()
    msg.dtype = int(dtype)
    msg.shape.extend(int(s) for s in a.shape)


def encode_sample_response(
    sequences: Sequence[SampledSeq],
    prompt_logprobs: Sequence[float] | np.ndarray | None = None,
    topk_prompt_logprobs: tuple[Any, Any] | None = None,
    prompt_cache_hit_tokens: int = 0,
    *,
    target_prompt_logprobs: np.ndarray | None = None,
    target_prompt_logprobs_csr: tuple[Sequence[int], Sequence[int]] | None = None,
    prompt_alt_tokens: tuple[Any, Any] | None = None,
) -> bytes:
    """Serialize a ``tinker_public.SampleResponse``.

    Args:
        sequences: the samples, in the order of the future's ``sample_sequence_ids``.
        prompt_logprobs: one float per prompt token (float32 on the wire); NaN where not
            scored (always position 0; the SDK turns NaN into None). None = not requested.
        topk_prompt_logprobs: ``(ids [P, K] int, logprobs [P, K] float)`` or None.
        prompt_cache_hit_tokens: prompt tokens served from a prefix cache.
        target_prompt_logprobs: dense float ``[P-1, K]`` logprobs of the requested target
            ids (0.0 in unused cells), or None.
        target_prompt_logprobs_csr: ``(crow_indices, col_indices)`` when the request's
            ``target_prompt_logprobs`` was CSR: the response then uses the same layout,
            gathering ``target_prompt_logprobs`` at the listed cells.
        prompt_alt_tokens: ``(ids [P-1, K] int, logprobs [P-1, K] float)`` or None.

    Returns:
        The serialized message (bytes).

    Raises:
        ValueError: an unknown ``stop_reason``, ``logprobs`` length not matching ``tokens``,
            or malformed top-k matrices.
    """
    out = SampleResponse(prompt_cache_hit_tokens=int(prompt_cache_hit_tokens))
    for n, s in enumerate(sequences):
        reason = _STOP_REASON_BY_NAME.get(s.stop_reason)
        if reason is None:
            raise ValueError(f"sequences[{n}].stop_reason {s.stop_reason!r} not 'stop'|'length'")
        m = out.sequences.add(stop_reason=int(reason))
        toks = np.asarray(s.tokens, dtype="<i4")
        m.tokens = toks.tobytes()
        if s.logprobs is not None:
            lps = np.asarray(s.logprobs, dtype="<f4")
            if lps.shape != toks.shape:
                raise ValueError(f"sequences[{n}]: {lps.size} logprobs for {toks.size} tokens")
            m.logprobs = lps.tobytes()
        if s.topk is not None:
            _fill_topk(m.topk_sampled_logprobs, s.topk)
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    if topk_prompt_logprobs is not None:
        _fill_topk(out.topk_prompt_logprobs, topk_prompt_logprobs)
    if target_prompt_logprobs is not None:
        dense = np.asarray(target_prompt_logprobs, dtype="<f4")
        t = out.target_prompt_logprobs
        if target_prompt_logprobs_csr is None:
            _fill_dense_tensor(t, dense, DType.FLOAT32)
        else:
            crow = np.asarray(target_prompt_logprobs_csr[0], dtype="<i8")
            col = np.asarray(target_prompt_logprobs_csr[1], dtype="<i8")
            rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
            t.sparse_csr.values = np.ascontiguousarray(dense[rows, col]).tobytes()
            t.sparse_csr.crow_indices = crow.tobytes()
            t.sparse_csr.col_indices = col.tobytes()
            t.dtype = int(DType.FLOAT32)
            t.shape.extend(int(s) for s in dense.shape)
    if prompt_alt_tokens is not None:
        _fill_dense_tensor(out.prompt_alt_tokens.tokens, prompt_alt_tokens[0], DType.INT32)
        _fill_dense_tensor(out.prompt_alt_tokens.logprobs, prompt_alt_tokens[1], DType.FLOAT32)
    return out.SerializeToString()


def encode_forward_backward_request(
    model_id: str,
    seq_id: int,
    data: Sequence[FwdBwdDatum],
    loss_fn: str,
    loss_fn_config: Mapping[str, float | str] | None = None,
    forward_only: bool = False,
) -> bytes:
    """Serialize a ``ForwardBackwardRequest`` the way the SDK does (for tests and tools).

    Tokens go out as one int32 ``encoded_text`` chunk; every loss_fn_inputs array as a
    dense tensor (integer → INT64, floating → FLOAT32) with its shape; numeric config
    values are written to both config maps, strings only to ``loss_fn_config_v2``.

    Returns:
        The serialized message (bytes), not compressed.
    """
    msg = ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn,
                                 forward_only=forward_only)
    for k, v in (loss_fn_config or {}).items():
        if isinstance(v, str):
            msg.loss_fn_config_v2[k].text = v
        else:
            msg.loss_fn_config[k] = float(v)
            msg.loss_fn_config_v2[k].number = float(v)
    for d in data:
        dm = msg.data.add()
        dm.model_input.add().encoded_text.tokens = np.asarray(d.tokens, dtype="<i4").tobytes()
        for key, arr in d.loss_fn_inputs.items():
            a, dt = _wire_array(arr)
            _fill_dense_tensor(dm.loss_fn_inputs[key], a, dt)
    return msg.SerializeToString()
