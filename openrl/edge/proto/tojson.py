"""The protobuf results as JSON, for clients that ask ``retrieve_future`` for JSON.

The SDK asks for ``ForwardBackwardOutput`` and ``SampleResponse`` as protobuf (``Accept:
application/x-protobuf``) and gets the worker's bytes unchanged. Any other client (curl, a
non-Python SDK) gets the same result as JSON, with the SDK's field names (``tinker/types``):

* ``ForwardBackwardOutput``: ``{"loss_fn_output_type", "loss_fn_outputs": [{name: TensorData}],
  "metrics"}``, one dict per datum, each ``TensorData`` ``{"data" (flattened), "dtype",
  "shape"}``;
* ``SampleResponse``: ``{"type": "sample", "sequences": [{"sequence_id", "stop_reason", "tokens",
  "logprobs"?, "topk_logprobs"?}], "prompt_logprobs"?, "topk_prompt_logprobs"?,
  "target_prompt_logprobs"?, "prompt_alt_tokens"?, "prompt_cache_hit_tokens"}``. A logprob that
  was not computed (``NaN`` on the wire, e.g. prompt position 0) is ``null``; top-k rows are
  lists of ``[token_id, logprob]`` pairs (``null`` for a position with none).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from openrl.edge.proto.schema import DType, ForwardBackwardOutput, SampleResponse

# wire DType -> (little-endian dtype on the wire, JSON dtype name); BF16 / INT32 are widened
# as the SDK widens them (proto/response_conv.py)
_DTYPES = {DType.FLOAT32: ("<f4", "float32"), DType.INT64: ("<i8", "int64"),
           DType.INT32: ("<i4", "int64"), DType.BFLOAT16: ("<u2", "float32")}


def _values(buf: bytes, dtype: int) -> tuple[np.ndarray, str]:
    le, name = _DTYPES.get(dtype, ("<f4", "float32"))
    arr = np.frombuffer(buf, dtype=le)
    if dtype == DType.BFLOAT16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr, name


def _numbers(arr: np.ndarray) -> list:
    """A flat list for JSON: NaN / inf become ``null`` (JSON has neither)."""
    out = arr.tolist()
    if arr.dtype.kind == "f":
        return [v if math.isfinite(v) else None for v in out]
    return out


def _tensor_json(t: Any) -> dict:
    """A ``Tensor`` message as the SDK's JSON ``TensorData`` (CSR kept as CSR)."""
    values, name = _values(t.sparse_csr.values if t.WhichOneof("encoding") == "sparse_csr" else t.dense, t.dtype)
    out = {"data": _numbers(values), "dtype": name, "shape": [int(s) for s in t.shape] or [len(values)]}
    if t.WhichOneof("encoding") == "sparse_csr":
        out["sparse_crow_indices"] = np.frombuffer(t.sparse_csr.crow_indices, dtype="<i8").tolist()
        out["sparse_col_indices"] = np.frombuffer(t.sparse_csr.col_indices, dtype="<i8").tolist()
    return out


def forward_backward_output_json(body: bytes) -> dict:
    """A serialized ``ForwardBackwardOutput`` as the SDK's JSON ``ForwardBackwardOutput``.

    Raises:
        google.protobuf.message.DecodeError: ``body`` is not such a message.
    """
    msg = ForwardBackwardOutput()
    msg.ParseFromString(body)
    outputs: list[dict] = []
    for rec in msg.loss_fn_outputs:
        n = int(rec.num_datums)
        if n == 0 and rec.fields:  # 0: the first field's datum count (as the SDK reads it)
            first = next(iter(rec.fields.values()))
            n = len(np.frombuffer(first.offsets, dtype="<i8")) - 1
        rows: list[dict] = [{} for _ in range(n)]
        for name, bt in rec.fields.items():
            values, dtype = _values(bt.data, bt.dtype)
            itemsize = np.dtype(_DTYPES.get(bt.dtype, ("<f4",))[0]).itemsize
            offsets = np.frombuffer(bt.offsets, dtype="<i8") // itemsize  # byte offsets -> elements
            trailing = [int(s) for s in bt.trailing_shape]
            width = math.prod(trailing) if trailing else 1
            for i in range(n):
                part = values[offsets[i]:offsets[i + 1]]
                rows[i][name] = {"data": _numbers(part), "dtype": dtype,
                                 "shape": [len(part) // max(1, width), *trailing]}
        outputs.extend(rows)
    return {"loss_fn_output_type": msg.loss_fn_output_type.rsplit(":", 1)[-1], "loss_fn_outputs": outputs,
            "metrics": dict(msg.metrics)}


def _topk_rows(t: Any) -> list[list[list] | None]:
    """``TopkLogprobs`` as per-position lists of ``[token_id, logprob]`` (empty cells dropped;
    ``None`` for a position with none), as the SDK's ``topk_to_lists`` reads them."""
    k, n = int(t.k), int(t.length)
    if k == 0 or n == 0:
        return []
    ids = np.frombuffer(t.token_ids, dtype="<i4").reshape(n, k).tolist()
    lps = np.frombuffer(t.logprobs, dtype="<f4").reshape(n, k).tolist()
    rows: list[list[list] | None] = []
    for r_ids, r_lps in zip(ids, lps):
        row = [[i, lp] for i, lp in zip(r_ids, r_lps) if not (i == 0 and lp == -99999.0)]
        rows.append(row or None)
    return rows


def sample_response_json(body: bytes, request_id: str) -> dict:
    """A serialized ``SampleResponse`` as JSON (the SDK's ``SampleResponse`` field names); each
    sequence's ``sequence_id`` is ``<request_id>:<i>``, as the future's ``sample_sequence_ids``.

    Raises:
        google.protobuf.message.DecodeError: ``body`` is not such a message.
    """
    msg = SampleResponse()
    msg.ParseFromString(body)
    seqs = []
    for i, s in enumerate(msg.sequences):
        seq: dict[str, Any] = {"sequence_id": f"{request_id}:{i}", "stop_reason": "length" if s.stop_reason == 1
                               else "stop", "tokens": np.frombuffer(s.tokens, dtype="<i4").tolist()}
        if s.HasField("logprobs"):
            seq["logprobs"] = _numbers(np.frombuffer(s.logprobs, dtype="<f4"))
        if s.HasField("topk_sampled_logprobs"):
            seq["topk_logprobs"] = _topk_rows(s.topk_sampled_logprobs)
        seqs.append(seq)
    out: dict[str, Any] = {"type": "sample", "sequences": seqs,
                           "prompt_cache_hit_tokens": int(msg.prompt_cache_hit_tokens)}
    if msg.HasField("prompt_logprobs"):
        out["prompt_logprobs"] = _numbers(np.frombuffer(msg.prompt_logprobs, dtype="<f4"))
    if msg.HasField("topk_prompt_logprobs"):
        out["topk_prompt_logprobs"] = _topk_rows(msg.topk_prompt_logprobs)
    if msg.HasField("target_prompt_logprobs"):
        out["target_prompt_logprobs"] = _tensor_json(msg.target_prompt_logprobs)
    if msg.HasField("prompt_alt_tokens"):
        out["prompt_alt_tokens"] = {"tokens": _tensor_json(msg.prompt_alt_tokens.tokens),
                                    "logprobs": _tensor_json(msg.prompt_alt_tokens.logprobs)}
    return out


def result_json(op: str, body: bytes, request_id: str) -> dict:
    """The protobuf result of future ``request_id`` (operation ``op``) as JSON: a
    ``SampleResponse`` for ``sample``, else a ``ForwardBackwardOutput``."""
    if op == "sample":
        return sample_response_json(body, request_id)
    return forward_backward_output_json(body)
