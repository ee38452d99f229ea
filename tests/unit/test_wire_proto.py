"""Protobuf bodies against the SDK's own codec: requests built by `tinker/proto/request_conv.py` decode
with ours; results we encode decode with `tinker/proto/response_conv.py`; malformed bodies → WireError."""

from __future__ import annotations

import math

import numpy as np
import pytest
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from services.wire.arrays import ForwardBackwardCall
from services.wire.errors import WireError
from services.wire.proto import (
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)
from services.wire.results import (
    ForwardBackwardOutput,
    PromptAltTokens,
    SampledSequence,
    SampleResponse,
    TopkLogprobs,
)


def sdk_request(
    data: list[types.Datum] | None = None,
    loss_fn: str = "cross_entropy",
    config: dict[str, float | str] | None = None,
    seq_id: int | None = 1,
) -> object:
    """The SDK's proto message for one forward_backward chunk (mutable, to corrupt in tests)."""
    if data is None:
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                loss_fn_inputs={
                    "target_tokens": np.array([2, 3, 4, 5], dtype=np.int64),
                    "weights": np.array([0, 1, 1, 1], dtype=np.float32),
                },
            )
        ]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="sess:train:0",
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request)


def decode(msg: object, **kwargs: object) -> ForwardBackwardCall:
    return decode_forward_backward_request(msg.SerializeToString(), **kwargs)  # type: ignore[attr-defined]


def test_sdk_encoded_request_decodes() -> None:
    call = decode(sdk_request())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == (
        "sess:train:0",
        1,
        "cross_entropy",
        False,
    )
    (datum,) = call.data
    assert datum.model_input[0].type == "encoded_text"
    np.testing.assert_array_equal(datum.model_input[0].tokens, [1, 2, 3, 4])
    target = datum.loss_fn_inputs["target_tokens"]
    assert target.dtype == np.int64 and target.flags.writeable
    np.testing.assert_array_equal(target, [2, 3, 4, 5])
    np.testing.assert_array_equal(datum.loss_fn_inputs["weights"], np.array([0, 1, 1, 1], np.float32))
    assert call.num_tokens == 4 and call.num_datums == 1


def test_zstd_body_forward_only_and_v2_config() -> None:
    msg = sdk_request(loss_fn="ppo", config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    msg.forward_only = True  # type: ignore[attr-defined]
    body = zstandard.ZstdCompressor().compress(msg.SerializeToString())  # type: ignore[attr-defined]
    call = decode_forward_backward_request(body, "zstd")
    assert call.forward_only
    assert call.loss_fn_config == pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})


def test_text_config_only_in_v2() -> None:
    call = decode(sdk_request(loss_fn="custom", config={"loss_id": "abc", "beta": 0.5}))
    assert call.loss_fn_config == {"loss_id": "abc", "beta": 0.5}


def test_two_d_sparse_targets_and_provenance() -> None:
    target = types.TensorData(
        data=np.array([7, 9], dtype=np.int64),
        dtype="int64",
        shape=[3, 2],
        sparse_crow_indices=[0, 1, 1, 2],
        sparse_col_indices=[1, 0],
    )
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": target, "weights": np.ones((3, 2), dtype=np.float32)},
    ).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="r:0", length=3)],
        loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="r:1", offset=2, length=3)],
    )
    (decoded,) = decode(sdk_request([datum])).data
    np.testing.assert_array_equal(decoded.loss_fn_inputs["target_tokens"], [[0, 7], [0, 0], [9, 0]])
    assert decoded.model_input_spans is not None and decoded.model_input_spans[0].source == "prompt"
    assert decoded.loss_fn_input_spans is not None and decoded.loss_fn_input_spans[0].offset == 2


def test_image_chunk_is_kept_as_kind_only() -> None:
    datum = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)]
        ),
        loss_fn_inputs={"target_tokens": np.zeros(4, dtype=np.int64)},
    )
    (decoded,) = decode(sdk_request([datum])).data
    assert decoded.model_input[0].type == "image" and decoded.model_input[0].tokens is None


@pytest.mark.parametrize(
    ("body", "encoding", "field"),
    [
        (b"\xff\xff\xff", None, "body"),
        (b"not zstd", "zstd", "body"),
        (b"x", "gzip", "Content-Encoding"),
    ],
)
def test_malformed_bodies(body: bytes, encoding: str | None, field: str) -> None:
    with pytest.raises(WireError) as err:
        decode_forward_backward_request(body, encoding)
    assert err.value.field == field


def test_zstd_bomb_is_refused_before_decompression() -> None:
    body = zstandard.ZstdCompressor().compress(b"\0" * 10_000)
    with pytest.raises(WireError, match="over the limit of 1000"):
        decode_forward_backward_request(body, "zstd", max_body_bytes=1000)


def test_missing_seq_id_is_rejected() -> None:
    with pytest.raises(WireError) as err:
        decode(sdk_request(seq_id=None))
    assert err.value.field == "seq_id" and err.value.model_id == "sess:train:0"


def test_wrong_dtype_names_field_and_carries_ids() -> None:
    msg = sdk_request()
    msg.data[0].loss_fn_inputs["weights"].dtype = 3  # type: ignore[attr-defined]  # DTYPE_INT32
    with pytest.raises(WireError) as err:
        decode(msg)
    assert err.value.field == "data[0].loss_fn_inputs.weights.dtype"
    assert "DTYPE_INT32" in err.value.message
    assert (err.value.model_id, err.value.seq_id) == ("sess:train:0", 1)


def test_shape_mismatch() -> None:
    msg = sdk_request()
    del msg.data[0].loss_fn_inputs["weights"].shape[:]  # type: ignore[attr-defined]
    msg.data[0].loss_fn_inputs["weights"].shape.extend([5])  # type: ignore[attr-defined]
    with pytest.raises(WireError) as err:
        decode(msg)
    assert err.value.field == "data[0].loss_fn_inputs.weights.shape"


def test_ragged_byte_count() -> None:
    msg = sdk_request()
    msg.data[0].model_input[0].encoded_text.tokens = b"\x01\x02\x03"  # type: ignore[attr-defined]
    with pytest.raises(WireError, match="multiple of 4"):
        decode(msg)


def test_sparse_shape_bomb_and_bad_csr() -> None:
    msg = sdk_request()
    tensor = msg.data[0].loss_fn_inputs["target_tokens"]  # type: ignore[attr-defined]
    tensor.sparse_csr.values = b""
    tensor.sparse_csr.crow_indices = np.zeros(1_000_001, dtype=np.int64).tobytes()
    del tensor.shape[:]
    tensor.shape.extend([1_000_000, 1_000_000])
    with pytest.raises(WireError, match="exceeds the limit"):
        decode(msg)
    del tensor.shape[:]
    tensor.shape.extend([2, 2])
    tensor.sparse_csr.crow_indices = np.array([0, 2, 1], dtype=np.int64).tobytes()
    with pytest.raises(WireError) as err:
        decode(msg)
    assert err.value.field.endswith("sparse_crow_indices")


def test_forward_backward_output_round_trips_through_sdk_decoder() -> None:
    outputs = [
        {"logprobs": np.array([-0.5, -1.0, -2.0], np.float32), "elementwise_loss": np.ones(3, np.float32)},
        {"logprobs": np.array([-0.25], np.float32), "elementwise_loss": np.zeros(1, np.float32)},
    ]
    out = ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss:sum": 3.25})
    sdk = deserialize_forward_backward_output(encode_forward_backward_output(out))
    assert sdk.loss_fn_output_type == "ArrayRecord"
    assert sdk.metrics == {"loss:sum": 3.25}
    assert len(sdk.loss_fn_outputs) == 2
    for ours, theirs in zip(outputs, sdk.loss_fn_outputs, strict=True):
        for name, arr in ours.items():
            assert theirs[name].dtype == "float32"
            assert theirs[name].shape == list(arr.shape)
            np.testing.assert_array_equal(theirs[name].to_numpy(), arr)


def test_ragged_trailing_shapes_become_separate_records() -> None:
    outputs = [
        {"logprobs": np.zeros((2, 3), np.float32)},
        {"logprobs": np.ones((4, 3), np.float32)},
        {"logprobs": np.full((1, 5), 2.0, np.float32)},
    ]
    sdk = deserialize_forward_backward_output(
        encode_forward_backward_output(ForwardBackwardOutput(loss_fn_outputs=outputs))
    )
    assert [o["logprobs"].shape for o in sdk.loss_fn_outputs] == [[2, 3], [4, 3], [1, 5]]
    np.testing.assert_array_equal(sdk.loss_fn_outputs[2]["logprobs"].to_numpy(), outputs[2]["logprobs"])


def test_empty_output_keeps_metrics() -> None:
    sdk = deserialize_forward_backward_output(
        encode_forward_backward_output(ForwardBackwardOutput(loss_fn_outputs=[], metrics={"loss:sum": 0.0}))
    )
    assert sdk.loss_fn_outputs == [] and sdk.metrics == {"loss:sum": 0.0}


@pytest.mark.parametrize("key", ["loss", "a:b:c", "loss:median", ":sum"])
def test_bad_metric_keys_are_refused(key: str) -> None:
    with pytest.raises(ValueError, match="name:reduction"):
        ForwardBackwardOutput(loss_fn_outputs=[], metrics={key: 1.0})


def test_sample_response_round_trips_through_sdk_decoder() -> None:
    topk = TopkLogprobs.from_rows([None, [(5, -0.1), (6, -2.0)], [(7, -0.3)]], k=2)
    response = SampleResponse(
        sequences=[
            SampledSequence(
                stop_reason="stop",
                tokens_np=np.array([11, 12, 151645]),
                logprobs_np=np.array([-0.1, -0.2, -0.05]),
                topk_logprobs_np=TopkLogprobs.from_rows([[(11, -0.1)], [(12, -0.2)], None], k=1),
            ),
            SampledSequence(stop_reason="length", tokens_np=np.array([13])),
        ],
        prompt_logprobs_np=np.array([np.nan, -1.5, -0.5], np.float32),
        topk_prompt_logprobs_np=topk,
        target_prompt_logprobs=np.array([[-1.0], [0.0]], np.float32),
        prompt_cache_hit_tokens=2,
        prompt_alt_tokens=PromptAltTokens(
            tokens=np.array([[3], [4]], np.int64), logprobs=np.array([[-0.7], [-0.9]], np.float32)
        ),
    )
    sdk = deserialize_sample_response(encode_sample_response(response))
    first, second = sdk.sequences
    assert (first.stop_reason, first.tokens) == ("stop", [11, 12, 151645])
    assert first.logprobs == pytest.approx([-0.1, -0.2, -0.05])
    assert first.topk_logprobs is not None and first.topk_logprobs[2] is None
    assert (second.stop_reason, second.tokens, second.logprobs) == ("length", [13], None)
    assert sdk.prompt_logprobs == [None, -1.5, -0.5]
    assert sdk.topk_prompt_logprobs == [
        None,
        [(5, pytest.approx(-0.1)), (6, -2.0)],
        [(7, pytest.approx(-0.3))],
    ]
    assert sdk.prompt_cache_hit_tokens == 2
    assert sdk.target_prompt_logprobs is not None and sdk.target_prompt_logprobs.shape == [2, 1]
    assert sdk.prompt_alt_tokens is not None
    assert sdk.prompt_alt_tokens.tokens.to_numpy().tolist() == [[3], [4]]


def test_minimal_sample_response_has_no_optional_parts() -> None:
    sdk = deserialize_sample_response(
        encode_sample_response(
            SampleResponse(sequences=[SampledSequence(stop_reason="stop", tokens_np=np.array([1]))])
        )
    )
    assert sdk.prompt_logprobs is None and sdk.topk_prompt_logprobs is None
    assert sdk.target_prompt_logprobs is None and sdk.prompt_alt_tokens is None
    assert math.isclose(sdk.prompt_cache_hit_tokens, 0)
