"""The ``tinker_public`` protobuf messages and the codecs the server needs.

- :mod:`.schema`: the message classes, built at import time from a ``FileDescriptorProto``
  written out there (package ``tinker_public``, proto3) in a private ``DescriptorPool``, and
  the wire enums :class:`DType` / :class:`StopReason`;
- :mod:`.types`: the plain values the codecs take and give (:class:`FwdBwdDatum`,
  :class:`FwdBwdRequest`, :class:`SampledSeq`);
- :mod:`.spans`: provenance spans (:func:`decode_spans`, the tiling check :func:`check_spans`);
- :mod:`.compress`: identity / zstd request bodies (:func:`decompress`);
- :mod:`.decode`: :func:`decode_forward_backward_request` (protobuf body, optionally zstd ->
  :class:`FwdBwdRequest` with dense numpy ``loss_fn_inputs``), :func:`peek_run_and_seq`;
- :mod:`.encode`: :func:`encode_forward_backward_output`, :func:`encode_sample_response`,
  and :func:`encode_forward_backward_request` (the inverse of the decoder, for tests and tools;
  the SDK does its own encoding).

Wire conventions: every numeric array travels as raw little-endian bytes;
``EncodedTextChunk.tokens`` is int32, CSR indices are int64, tensor values use the tensor's
``DType``. Field names, numbers, types and proto3 ``optional`` presence match the wire of the
``tinker`` 0.38.0 SDK exactly (``tests/unit/test_proto.py`` checks this against the SDK's descriptor).
"""

from openrl.edge.proto.compress import MAX_DECOMPRESSED_BYTES, decompress, decompress_head
from openrl.edge.proto.decode import (
    HEAD_BYTES,
    LOSS_FN_INPUT_KINDS,
    MAX_TENSOR_ELEMENTS,
    csr_to_dense,
    decode_forward_backward_request,
    peek_run_and_seq,
)
from openrl.edge.proto.encode import (
    encode_forward_backward_output,
    encode_forward_backward_request,
    encode_sample_response,
)
from openrl.edge.proto.schema import (  # noqa: F401 - the message classes, importable from here
    FILE_DESCRIPTOR,
    FILE_DESCRIPTOR_PROTO,
    FILE_NAME,
    PACKAGE,
    ArrayRecord,
    BatchedTensor,
    Chunk,
    Datum,
    DmelChunk,
    DType,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    ImageChunk,
    ImageDimensions,
    LossConfigValue,
    PromptAltTokens,
    PromptProvenanceSpan,
    ProvenanceSpan,
    SampledProvenanceSpan,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SparseCsr,
    StopReason,
    StopStrings,
    StopTokens,
    Tensor,
    TopkLogprobs,
)
from openrl.edge.proto.spans import check_spans, decode_spans, encode_spans
from openrl.edge.proto.types import FwdBwdDatum, FwdBwdRequest, SampledSeq, Span

__all__ = [
    "Span",
    "check_spans",
    "decode_spans",
    "encode_spans",
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
    "decompress",
    "decompress_head",
    "FILE_DESCRIPTOR",
    "MAX_TENSOR_ELEMENTS",
    "LOSS_FN_INPUT_KINDS",
    "MAX_DECOMPRESSED_BYTES",
]
