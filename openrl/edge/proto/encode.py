"""Encoding: ``ForwardBackwardOutput`` and ``SampleResponse`` (what the functions answer), and
``ForwardBackwardRequest`` (the SDK's encoding, for tests and tools)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from openrl.edge.proto.schema import (
    _STOP_REASON_BY_NAME,
    DType,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    SampleResponse,
)
from openrl.edge.proto.types import FwdBwdDatum, SampledSeq
from openrl.edge.proto.spans import encode_spans

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
    loss_fn_output_type: str = "TorchLossReturn",
) -> bytes:
    """Serialize a ``tinker_public.ForwardBackwardOutput``.

    Args:
        loss_fn_outputs: one dict per datum, in request order; every dict has the same
            keys. Each value is array-like with shape ``[T_i, *trailing]`` (a 0-d value
            is sent as ``[1]``); where ``trailing`` changes from one datum to the next (e.g.
            ``[T, K]`` logprobs with another K), a new ``ArrayRecord`` starts.
            Floating (and bool) arrays go out as FLOAT32, integer arrays as INT64. The
            SDK expects at least ``logprobs`` (float32, shape of ``target_tokens``).
        metrics: ``"name:reduction"`` → float, e.g. ``{"loss:sum": 1.5}``; the SDK merges
            chunk metrics by the reduction (mean|sum|min|max|slack|hash2|unique).
        loss_fn_output_type: class tag of the message and of each record; the SDK shows the
            part after the last ``:``. ``TorchLossReturn`` is what hosted Tinker sends for its
            built-in losses, as the SDK's own tests model it (``tests/test_proto_response_conv.py``);
            code that compares ``result.loss_fn_output_type`` sees the same string here.

    Returns:
        The serialized message (bytes): ``ArrayRecord`` s with ``num_datums`` set (one
        unless trailing shapes are ragged) and one ``BatchedTensor`` per key (the record's
        datums' data concatenated, ``num_datums + 1`` int64 byte offsets).

    Raises:
        ValueError: datums with different keys, a non-numeric
            array, or a metric name without exactly one ``:`` (server bugs, not user errors).
    """
    for name in metrics:
        if name.count(":") != 1:
            raise ValueError(f"metric name {name!r} must have the form 'name:reduction'")
    out = ForwardBackwardOutput(loss_fn_output_type=loss_fn_output_type)
    for name, value in metrics.items():
        out.metrics[name] = float(value)
    if not loss_fn_outputs:
        out.loss_fn_outputs.add(type_tag=loss_fn_output_type, num_datums=0)
        return out.SerializeToString()
    keys = list(loss_fn_outputs[0].keys())
    for i, d in enumerate(loss_fn_outputs):
        if set(d.keys()) != set(keys):
            raise ValueError(f"loss_fn_outputs[{i}] keys {sorted(d)} differ from {sorted(keys)}")
    arrays: list[dict[str, tuple[np.ndarray, DType]]] = []
    for d in loss_fn_outputs:
        row = {}
        for key in keys:
            a, dt = _wire_array(d[key])
            row[key] = (a.reshape(1) if a.ndim == 0 else a, dt)
        arrays.append(row)
    # One ArrayRecord per run of datums whose trailing shapes agree on every key: ragged
    # outputs (e.g. [T, K] logprobs with a different K per datum, or 1-D next to 2-D) go out
    # as several internally rectangular records, which the SDK concatenates in order.
    start = 0
    for end in range(1, len(arrays) + 1):
        if end < len(arrays) and all(
            arrays[end][k][0].shape[1:] == arrays[start][k][0].shape[1:] for k in keys
        ):
            continue
        _fill_record(out.loss_fn_outputs.add(type_tag=loss_fn_output_type, num_datums=end - start),
                     keys, arrays[start:end])
        start = end
    return out.SerializeToString()


def _fill_record(rec: Any, keys: Sequence[str], rows: Sequence[Mapping[str, tuple[np.ndarray, DType]]]) -> None:
    """One ``ArrayRecord``: per key, the rows' arrays (same trailing shape) concatenated, with
    ``len(rows) + 1`` int64 byte offsets; a key's dtype is its first row's (others are cast)."""
    for key in keys:
        dtype = rows[0][key][1]
        trailing = rows[0][key][0].shape[1:]
        parts = []
        for a, dt in (r[key] for r in rows):
            if dt != dtype:
                a = a.astype("<f4" if dtype == DType.FLOAT32 else "<i8")
            parts.append(np.ascontiguousarray(a))
        sizes = np.array([0] + [a.nbytes for a in parts], dtype="<i8")
        bt = rec.fields[key]
        bt.data = b"".join(a.tobytes() for a in parts)
        bt.offsets = np.cumsum(sizes).astype("<i8").tobytes()
        bt.dtype = int(dtype)
        bt.trailing_shape.extend(int(s) for s in trailing)


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
        encode_spans(dm.model_input_spans, d.model_input_spans)
        encode_spans(dm.loss_fn_input_spans, d.loss_fn_input_spans)
    return msg.SerializeToString()
