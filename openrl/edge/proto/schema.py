"""The ``tinker_public`` protobuf schema: a ``FileDescriptorProto`` written out here, built at
import time into message classes in a private ``DescriptorPool`` (so this module can live next
to the SDK's own generated module in one process), plus the wire enums.

Field names, numbers, types and proto3 ``optional`` presence match the wire of the ``tinker``
0.38.0 SDK exactly (``tests/unit/test_proto.py`` checks this against the SDK's descriptor).
"""

from __future__ import annotations

import enum
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

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
