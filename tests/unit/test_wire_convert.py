"""Training-side wire ⇄ domain conversions, id/path schemes, and the body-format dispatcher."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from services.domain import training as domain
from services.domain.backend import BaseModelInfo
from services.wire import paths
from services.wire.arrays import DatumArrays, ForwardBackwardCall, InputChunk
from services.wire.convert import (
    adam_params,
    check_optimizer_config,
    decode_forward_backward_body,
    forward_backward_output,
    forward_backward_work,
    get_info_response,
    lora_spec,
    optim_step_response,
    request_failed,
)
from services.wire.errors import WireError
from services.wire.inputs import AdamParams, LoraConfig, OptimizerConfigBase, OptimParamsBase
from services.wire.proto import encode_forward_backward_output

ADAPTER = domain.AdapterId("a1")


def datum(**inputs: np.ndarray) -> DatumArrays:
    return DatumArrays(
        model_input=[InputChunk("encoded_text", np.array([1, 2, 3], np.int32))], loss_fn_inputs=inputs
    )


def call(
    *data: DatumArrays, loss_fn: str = "cross_entropy", config: dict[str, float | str] | None = None
) -> ForwardBackwardCall:
    return ForwardBackwardCall("m", 4, loss_fn, config or {}, False, list(data))


def ce_inputs() -> dict[str, np.ndarray]:
    return {"target_tokens": np.array([2, 3, 4], np.int64), "weights": np.array([0, 1, 1], np.float32)}


def test_cross_entropy_work() -> None:
    extra = {"mask": np.ones(3, np.float32)}
    work = forward_backward_work(call(datum(**ce_inputs(), **extra)), ADAPTER)
    assert (work.adapter_id, work.loss_fn, work.forward_only) == (ADAPTER, "cross_entropy", False)
    (d,) = work.data
    assert d.tokens.dtype == np.int64 and d.tokens.tolist() == [1, 2, 3]
    assert set(d.loss_inputs) == {"target_tokens", "weights"}  # unused keys dropped


def test_ppo_work_with_config_and_topk_targets() -> None:
    inputs = {
        "target_tokens": np.zeros((3, 2), np.int64),
        "logprobs": np.zeros((3, 2), np.float32),
        "advantages": np.ones((3, 2), np.float32),
    }
    work = forward_backward_work(
        call(datum(**inputs), loss_fn="ppo", config={"clip_low_threshold": 0.8}), None
    )
    assert work.loss_config == {"clip_low_threshold": 0.8} and work.adapter_id is None


def test_cross_entropy_without_weights_is_accepted() -> None:
    """The SDK's own `forward` example sends no weights: every target then counts once (engine default)."""
    work = forward_backward_work(call(datum(target_tokens=np.array([2, 3, 4], np.int64))), ADAPTER)
    assert set(work.data[0].loss_inputs) == {"target_tokens"}


@pytest.mark.parametrize(
    ("the_call", "field"),
    [
        (call(datum(**ce_inputs()), loss_fn="fancy_loss"), "loss_fn"),
        (call(), "data"),
        (
            call(datum(target_tokens=np.array([2.0, 3, 4], np.float32), weights=np.ones(3, np.float32))),
            "data[0].loss_fn_inputs.target_tokens.dtype",
        ),
        (
            call(datum(target_tokens=np.array([2, 3], np.int64), weights=np.ones(2, np.float32))),
            "data[0].loss_fn_inputs.target_tokens.shape",
        ),
        (
            call(datum(target_tokens=np.array([2, 3, 4], np.int64), weights=np.ones(3, np.int64))),
            "data[0].loss_fn_inputs.weights.dtype",
        ),
        (
            call(datum(target_tokens=np.array([2, 3, 4], np.int64), weights=np.ones(4, np.float32))),
            "data[0].loss_fn_inputs.weights.shape",
        ),
        (
            call(
                datum(
                    target_tokens=np.array([2, 3, 4], np.int64), weights=np.array([1, np.nan, 1], np.float32)
                )
            ),
            "data[0].loss_fn_inputs.weights",
        ),
        (
            call(datum(target_tokens=np.array([2, -3, 4], np.int64), weights=np.ones(3, np.float32))),
            "data[0].loss_fn_inputs.target_tokens",
        ),
        (call(DatumArrays([InputChunk("image")], ce_inputs())), "data[0].model_input[0]"),
        (
            call(DatumArrays([InputChunk("encoded_text", np.zeros(0, np.int32))], ce_inputs())),
            "data[0].model_input",
        ),
        (call(datum(**ce_inputs()), config={"loss_id": "x"}), "loss_fn_config.loss_id"),
        (call(datum(**ce_inputs()), config={"beta": float("inf")}), "loss_fn_config.beta"),
    ],
)
def test_bad_calls_name_the_field_and_carry_ids(the_call: ForwardBackwardCall, field: str) -> None:
    with pytest.raises(WireError) as err:
        forward_backward_work(the_call, ADAPTER)
    assert err.value.field == field
    assert (err.value.model_id, err.value.seq_id) == ("m", 4)


def sdk_proto_body(forward_only: bool = False) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=ce_inputs())],
            loss_fn="cross_entropy",
        ),
        model_id="s:train:0",
        seq_id=1,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_dispatch_protobuf_and_legacy_json_agree() -> None:
    from_proto = decode_forward_backward_body(
        zstandard.ZstdCompressor().compress(sdk_proto_body()), "application/x-protobuf", "zstd"
    )
    legacy = {
        "forward_input": {
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                    "loss_fn_inputs": {
                        "target_tokens": {"data": [2, 3, 4], "dtype": "int64", "shape": [3]},
                        "weights": {"data": [0, 1, 1], "dtype": "float32"},
                    },
                }
            ],
            "loss_fn": "cross_entropy",
        },
        "model_id": "s:train:0",
        "seq_id": 1,
    }
    from_json = decode_forward_backward_body(
        json.dumps(legacy).encode(), "application/json", legacy_forward=True
    )
    assert from_json.forward_only and not from_proto.forward_only
    a = forward_backward_work(from_proto, ADAPTER).data[0]
    b = forward_backward_work(from_json, ADAPTER).data[0]
    np.testing.assert_array_equal(a.tokens, b.tokens)
    for key in ("target_tokens", "weights"):
        assert a.loss_inputs[key].dtype == b.loss_inputs[key].dtype
        np.testing.assert_array_equal(a.loss_inputs[key], b.loss_inputs[key])


def test_legacy_json_errors_carry_ids() -> None:
    body = {
        "forward_backward_input": {
            "data": [
                {
                    "model_input": {"chunks": [{"tokens": [1]}]},
                    "loss_fn_inputs": {"weights": {"data": [1.0], "dtype": "float32", "shape": [2]}},
                }
            ],
            "loss_fn": "cross_entropy",
        },
        "model_id": "m",
        "seq_id": 9,
    }
    with pytest.raises(WireError) as err:
        decode_forward_backward_body(json.dumps(body).encode(), "application/json")
    assert err.value.field == "forward_backward_input.data[0].loss_fn_inputs.weights.shape"
    assert (err.value.model_id, err.value.seq_id) == ("m", 9)


def test_lora_optimizer_and_adam() -> None:
    spec = lora_spec(LoraConfig(rank=8, seed=3, train_unembed=False))
    assert (spec.rank, spec.seed, spec.train_unembed, spec.train_mlp) == (8, 3, False, True)
    assert lora_spec(None) == domain.LoraSpec()
    check_optimizer_config(OptimizerConfigBase())
    check_optimizer_config(None)
    with pytest.raises(WireError, match="adamw"):
        check_optimizer_config(OptimizerConfigBase.model_validate({"type": "dimuon", "version": 1}))
    assert adam_params(AdamParams(learning_rate=1e-3)) == domain.AdamParams(learning_rate=1e-3)
    with pytest.raises(WireError) as err:
        adam_params(OptimParamsBase(type="dimuon"))
    assert err.value.field == "optim_params.type"


def test_results_to_wire() -> None:
    result = domain.ForwardBackwardResult(
        outputs=[
            domain.DatumOutput(
                logprobs=np.array([-1.0, -2.0], np.float32), elementwise_loss=np.array([1.0, 2.0])
            )
        ],
        metrics={"loss:sum": 3.0},
    )
    sdk = deserialize_forward_backward_output(encode_forward_backward_output(forward_backward_output(result)))
    assert sdk.metrics == {"loss:sum": 3.0}
    assert sdk.loss_fn_outputs[0]["logprobs"].to_numpy().tolist() == [-1.0, -2.0]
    assert sdk.loss_fn_outputs[0]["elementwise_loss"].dtype == "float32"
    with pytest.raises(ValueError, match="name:reduction"):
        forward_backward_output(domain.ForwardBackwardResult(outputs=[], metrics={"loss": 1.0}))
    assert optim_step_response(domain.OptimStepResult(metrics={"grad_norm:mean": 2.0})).metrics == {
        "grad_norm:mean": 2.0
    }
    failed = request_failed(domain.WorkError("boom", category="server"))
    assert (failed.error, failed.category) == ("boom", "server")
    assert request_failed(WireError("seq_id", "must be >= 1")).category == "user"


def test_get_info_response_validates_in_sdk() -> None:
    info = BaseModelInfo("HuggingFaceTB/SmolLM2-135M-Instruct", "llama", 49152, 2048, "/tmp/tok", (2,))
    answer = get_info_response("s:train:0", info, domain.LoraSpec(rank=8))
    sdk = types.GetInfoResponse.model_validate_json(json.dumps(answer.model_dump(mode="json")), strict=True)
    assert sdk.model_data.model_name == info.name and sdk.lora_rank == 8 and sdk.is_lora


def test_id_schemes_and_paths_agree_with_sdk() -> None:
    run = "sess-abc:train:0"
    assert paths.sample_sequence_ids("r5", 2) == ["r5:0", "r5:1"]
    assert paths.cloned_sampler_id(3_000_000_007) == 3
    for kind in ("training", "sampler", "external"):
        uri = paths.checkpoint_path(run, kind, "ckpt1")
        ours = paths.parse_tinker_path(uri)
        theirs = types.ParsedCheckpointTinkerPath.from_tinker_path(uri)
        assert (ours.training_run_id, ours.checkpoint_type, ours.checkpoint_id, ours.uri) == (
            theirs.training_run_id,
            theirs.checkpoint_type,
            theirs.checkpoint_id,
            uri,
        )
    assert paths.parse_checkpoint_id(run, "weights/ckpt1").name == "ckpt1"
    for bad in ("http://x/weights/a", "tinker://x/weights", "tinker://x/other/a", "tinker://x/weights/a/b"):
        with pytest.raises(WireError):
            paths.parse_tinker_path(bad)
