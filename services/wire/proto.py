"""Protobuf bodies: decode `ForwardBackwardRequest` (optionally zstd), encode the two proto results.

Uses the SDK's own generated module (`tinker.proto.tinker_public_pb2`, package `tinker_public`) — the
only place in the project allowed to import it. Decoding is defensive (body-size cap before and after
zstd, dtype / shape / CSR checks, a dense-size cap) and every failure is a `WireError` naming the field
and carrying the body's `model_id` / `seq_id` when they were readable, so the gateway can still consume
the seq_id. Encoding writes exactly what `tinker/proto/response_conv.py` decodes (protocol §5.4).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from services.wire.arrays import (
    DatumArrays,
    ElementBudget,
    ForwardBackwardCall,
    InputChunk,
    ProvenanceSpan,
    TensorLimits,
    csr_tensor,
    dense_tensor,
    wanted_loss_inputs,
)
from services.wire.errors import WireError
from services.wire.results import ForwardBackwardOutput, SampleResponse, TopkLogprobs

CONTENT_TYPE_PROTOBUF = "application/x-protobuf"
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
"""Largest (decompressed) forward_backward body; the SDK's default chunk is ~5 MB."""

_TENSOR_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def decompress_body(
    body: bytes, content_encoding: str | None, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> bytes:
    """Undo `Content-Encoding` (identity or zstd), never producing more than `max_body_bytes`."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        if len(body) > max_body_bytes:
            raise WireError("body", f"{len(body)} bytes exceeds the limit of {max_body_bytes}")
        return body
    if encoding != "zstd":
        raise WireError("Content-Encoding", f"must be zstd or identity, got {content_encoding!r}")
    try:
        # A frame may declare its size; refuse a declared bomb before allocating anything.
        declared = zstandard.frame_content_size(body)
        if declared > max_body_bytes:
            raise WireError("body", f"decompresses to {declared} bytes, over the limit of {max_body_bytes}")
        return bytes(zstandard.ZstdDecompressor().decompress(body, max_output_size=max_body_bytes))
    except zstandard.ZstdError as exc:
        raise WireError("body", f"bad zstd data (or over {max_body_bytes} bytes): {exc}") from exc


def decode_forward_backward_request(
    body: bytes,
    content_encoding: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: TensorLimits | None = None,
) -> ForwardBackwardCall:
    """Decode a protobuf `forward_backward` body (forward-only passes use the same message)."""
    return call_from_message(parse_forward_backward_message(body, content_encoding, max_body_bytes=max_body_bytes),
                             limits)


def parse_forward_backward_message(
    body: bytes, content_encoding: str | None = None, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> pb.ForwardBackwardRequest:
    """Parse (no tensor is densified yet): the ids are readable for an ownership check first."""
    raw = decompress_body(body, content_encoding, max_body_bytes=max_body_bytes)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise WireError("body", f"malformed ForwardBackwardRequest protobuf: {exc}") from exc
    return msg


def message_ids(msg: pb.ForwardBackwardRequest) -> tuple[str | None, int | None]:
    """`(model_id, seq_id)` of a parsed message, None where unset or invalid."""
    return msg.model_id or None, msg.seq_id if msg.seq_id >= 1 else None


def call_from_message(msg: pb.ForwardBackwardRequest, limits: TensorLimits | None = None) -> ForwardBackwardCall:
    """The decoded call: tensors checked and densified within `limits`; errors carry the message's ids."""
    try:
        return _call_from_message(msg, ElementBudget(limits))
    except WireError as err:
        raise err.with_ids(*message_ids(msg)) from None


def _call_from_message(msg: pb.ForwardBackwardRequest, budget: ElementBudget) -> ForwardBackwardCall:
    if not msg.model_id:
        raise WireError("model_id", "is required")
    if msg.seq_id < 1:
        # proto3 writes an unset seq_id as 0; training requests count from 1.
        raise WireError("seq_id", f"must be >= 1, got {msg.seq_id}")
    if not msg.loss_fn:
        raise WireError("loss_fn", "is required")
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=_loss_fn_config(msg),
        forward_only=msg.forward_only,
        data=[_datum(d, f"data[{i}]", msg.loss_fn, budget) for i, d in enumerate(msg.data)],
    )


def _loss_fn_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    # v2 carries every numeric key of the legacy map plus text values; prefer it when present.
    if not msg.loss_fn_config_v2:
        return {k: float(v) for k, v in msg.loss_fn_config.items()}
    config: dict[str, float | str] = {}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise WireError(f"loss_fn_config_v2.{key}", "has neither number nor text")
        config[key] = value.number if kind == "number" else value.text
    return config


def _datum(msg: pb.Datum, field: str, loss_fn: str, budget: ElementBudget) -> DatumArrays:
    wanted = wanted_loss_inputs(loss_fn, list(msg.loss_fn_inputs), f"{field}.loss_fn_inputs")
    return DatumArrays(
        model_input=[_chunk(c, f"{field}.model_input[{j}]") for j, c in enumerate(msg.model_input)],
        loss_fn_inputs={
            name: _tensor(t, f"{field}.loss_fn_inputs.{name}", budget)
            for name, t in msg.loss_fn_inputs.items() if name in wanted
        },
        model_input_spans=_spans(msg.model_input_spans) if len(msg.model_input_spans) else None,
        loss_fn_input_spans=_spans(msg.loss_fn_input_spans) if len(msg.loss_fn_input_spans) else None,
    )


def _chunk(msg: pb.Chunk, field: str) -> InputChunk:
    kind = msg.WhichOneof("chunk")
    if kind == "encoded_text":
        return InputChunk(
            "encoded_text", _frombuffer(msg.encoded_text.tokens, np.dtype("<i4"), f"{field}.tokens")
        )
    if kind in ("image", "dmel"):
        return InputChunk(kind)
    raise WireError(field, "empty chunk: none of encoded_text, image, dmel is set")


def _tensor(msg: pb.Tensor, field: str, budget: ElementBudget) -> np.ndarray:
    dtype = _TENSOR_DTYPES.get(msg.dtype)
    if dtype is None:
        name = pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else str(msg.dtype)
        raise WireError(f"{field}.dtype", f"must be DTYPE_FLOAT32 or DTYPE_INT64, got {name}")
    shape = list(msg.shape)
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        values = _frombuffer(csr.values, dtype, f"{field}.sparse_csr.values")
        crow = _frombuffer(csr.crow_indices, np.dtype("<i8"), f"{field}.sparse_csr.crow_indices")
        col = _frombuffer(csr.col_indices, np.dtype("<i8"), f"{field}.sparse_csr.col_indices")
        return csr_tensor(values, crow, col, shape, field, budget)
    return dense_tensor(_frombuffer(msg.dense, dtype, f"{field}.dense"), shape, field, budget)


def _frombuffer(buf: bytes, dtype: np.dtype, field: str) -> np.ndarray:
    if len(buf) % dtype.itemsize:
        raise WireError(field, f"{len(buf)} bytes is not a multiple of {dtype.itemsize} ({dtype.name})")
    # Copy: frombuffer views the immutable bytes, and torch warns on read-only arrays downstream.
    return np.frombuffer(buf, dtype=dtype).astype(dtype.newbyteorder("="), copy=True)


def _spans(msgs: Sequence[pb.ProvenanceSpan]) -> list[ProvenanceSpan]:
    spans: list[ProvenanceSpan] = []
    for span in msgs:
        if span.WhichOneof("span") == "sampled_tokens":
            s = span.sampled_tokens
            spans.append(ProvenanceSpan("sampled", s.sequence_id, int(s.offset), int(s.length)))
        else:
            p = span.prompt_tokens
            spans.append(ProvenanceSpan("prompt", p.sequence_id, int(p.offset), int(p.length)))
    return spans


def encode_forward_backward_output(output: ForwardBackwardOutput) -> bytes:
    """Serialize a result as `tinker_public.ForwardBackwardOutput` (one ArrayRecord per uniform run)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=output.loss_fn_output_type)
    for key, value in output.metrics.items():
        msg.metrics[key] = value
    outputs = [{name: _wire_array(arr) for name, arr in out.items()} for out in output.loss_fn_outputs]
    for start, stop in _uniform_runs(outputs):
        _fill_record(msg.loss_fn_outputs.add(), outputs[start:stop])
    return bytes(msg.SerializeToString())


def _wire_array(arr: np.ndarray) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype.kind == "f":
        arr = arr.astype("<f4", copy=False)
    elif arr.dtype.kind in "iu":
        arr = arr.astype("<i8", copy=False)
    else:
        raise ValueError(f"output arrays must be float or integer, got {arr.dtype}")
    return arr.reshape(1) if arr.ndim == 0 else arr


def _uniform_runs(outputs: list[dict[str, np.ndarray]]) -> list[tuple[int, int]]:
    """Consecutive datum ranges sharing dtype and trailing shape per field (one record each)."""

    def signature(out: dict[str, np.ndarray]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        return tuple(sorted((name, a.dtype.str, a.shape[1:]) for name, a in out.items()))

    runs: list[tuple[int, int]] = []
    for i, out in enumerate(outputs):
        if runs and signature(outputs[runs[-1][0]]) == signature(out):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _fill_record(record: pb.ArrayRecord, datums: list[dict[str, np.ndarray]]) -> None:
    record.num_datums = len(datums)
    for name, first in datums[0].items():
        arrays = [d[name] for d in datums]
        tensor = record.fields[name]
        tensor.dtype = pb.DTYPE_FLOAT32 if first.dtype.kind == "f" else pb.DTYPE_INT64
        tensor.trailing_shape.extend(first.shape[1:])
        # Offsets are *byte* offsets into the concatenated data, num_datums + 1 of them.
        offsets = np.zeros(len(arrays) + 1, dtype="<i8")
        np.cumsum([a.nbytes for a in arrays], out=offsets[1:])
        tensor.offsets = offsets.tobytes()
        tensor.data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def encode_sample_response(response: SampleResponse) -> bytes:
    """Serialize a result as `tinker_public.SampleResponse`."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=response.prompt_cache_hit_tokens)
    for seq in response.sequences:
        out = msg.sequences.add()
        out.stop_reason = _STOP_REASONS[seq.stop_reason]
        out.tokens = _int32_bytes(seq.tokens_np)
        if seq.logprobs_np is not None:
            out.logprobs = np.asarray(seq.logprobs_np, dtype="<f4").tobytes()
        if seq.topk_logprobs_np is not None:
            _fill_topk(out.topk_sampled_logprobs, seq.topk_logprobs_np)
    if response.prompt_logprobs_np is not None:
        msg.prompt_logprobs = np.asarray(response.prompt_logprobs_np, dtype="<f4").tobytes()
    if response.topk_prompt_logprobs_np is not None:
        _fill_topk(msg.topk_prompt_logprobs, response.topk_prompt_logprobs_np)
    if response.target_prompt_logprobs is not None:
        _fill_tensor(msg.target_prompt_logprobs, response.target_prompt_logprobs, "<f4")
    if response.prompt_alt_tokens is not None:
        _fill_tensor(msg.prompt_alt_tokens.tokens, response.prompt_alt_tokens.tokens, "<i8")
        _fill_tensor(msg.prompt_alt_tokens.logprobs, response.prompt_alt_tokens.logprobs, "<f4")
    return bytes(msg.SerializeToString())


def _int32_bytes(tokens: np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.size and (int(arr.min()) < -(2**31) or int(arr.max()) >= 2**31):
        raise ValueError("token ids must fit in int32")
    return arr.astype("<i4").tobytes()


def _fill_topk(msg: pb.TopkLogprobs, topk: TopkLogprobs) -> None:
    length, k = topk.token_ids.shape
    msg.SetInParent()
    msg.length, msg.k = length, k
    msg.token_ids = _int32_bytes(topk.token_ids)
    msg.logprobs = np.asarray(topk.logprobs, dtype="<f4").tobytes()


def _fill_tensor(msg: pb.Tensor, arr: np.ndarray, dtype: str) -> None:
    arr = np.asarray(arr, dtype=dtype)
    msg.dtype = pb.DTYPE_FLOAT32 if dtype == "<f4" else pb.DTYPE_INT64
    msg.shape.extend(arr.shape)
    msg.dense = arr.tobytes()
