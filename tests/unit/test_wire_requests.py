"""Request models accept every body the SDK 0.38 sends (built and dumped exactly as the SDK does) and
reject what matters with a WireError naming the field."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pydantic
import pytest
from tinker import types
from tinker.types.generic_event import GenericEvent
from tinker.types.session_start_event import SessionStartEvent

from services.wire import control, inputs, requests, rest
from services.wire.errors import WireError, parse_request


def sdk_body(model: pydantic.BaseModel) -> bytes:
    """What the SDK puts on the wire for a JSON request (`model_dump(exclude_none=True, mode="json")`)."""
    return json.dumps(model.model_dump(exclude_unset=False, exclude_none=True, mode="json")).encode()


def roundtrip(ours: type[pydantic.BaseModel], sdk: pydantic.BaseModel) -> Any:
    parsed = parse_request(ours, sdk_body(sdk))
    assert isinstance(parsed, ours)
    return parsed


def test_session_and_config_bodies() -> None:
    body = roundtrip(
        control.CreateSessionRequest,
        types.CreateSessionRequest(
            tags=["a"], user_metadata={"k": 1}, sdk_version="0.38.0", display_name="x"
        ),
    )
    assert (body.tags, body.user_metadata, body.display_name) == (["a"], {"k": 1}, "x")
    assert roundtrip(control.ClientConfigRequest, types.ClientConfigRequest(sdk_version="0.38.0")).sdk_version
    assert (
        roundtrip(control.SessionHeartbeatRequest, types.SessionHeartbeatRequest(session_id="s")).session_id
        == "s"
    )
    finish = parse_request(control.SessionFinishRequest, {"reason": {"type": "success"}, "detail": None})
    assert finish.reason.type == "success"


def test_create_model_and_get_info() -> None:
    sdk = types.CreateModelRequest(
        session_id="s",
        model_seq_id=0,
        base_model="Qwen/Qwen3-8B",
        lora_config=types.LoraConfig(rank=16, seed=1, train_unembed=False),
    )
    body = roundtrip(requests.CreateModelRequest, sdk)
    assert body.lora_config is not None and (body.lora_config.rank, body.lora_config.seed) == (16, 1)
    assert body.optimizer_config.type == "adamw"
    dimuon = types.CreateModelRequest(
        session_id="s", model_seq_id=1, base_model="b", optimizer_config=types.DimuonOptimizerConfig()
    )
    parsed = roundtrip(requests.CreateModelRequest, dimuon)
    assert parsed.optimizer_config.type == "dimuon"
    assert (
        roundtrip(requests.GetInfoRequest, types.GetInfoRequest(model_id="s:train:0")).model_id == "s:train:0"
    )


def test_optim_step_adam_and_other_families() -> None:
    adam = roundtrip(
        requests.OptimStepRequest,
        types.OptimStepRequest(optim_params=types.AdamParams(learning_rate=1e-3), model_id="m", seq_id=2),
    )
    assert isinstance(adam.optim_params, inputs.AdamParams) and adam.optim_params.learning_rate == 1e-3
    other = roundtrip(
        requests.OptimStepRequest,
        types.OptimStepRequest(optim_params=types.DimuonParams(learning_rate=0.1), model_id="m", seq_id=3),
    )
    assert isinstance(other.optim_params, inputs.OptimParamsBase) and other.optim_params.type == "dimuon"


def test_save_and_load_bodies() -> None:
    save = roundtrip(
        requests.SaveWeightsRequest,
        types.SaveWeightsRequest(
            model_id="m", path="ckpt1", seq_id=3, ttl_seconds=7200, user_metadata={"a": "b"}
        ),
    )
    assert (save.path, save.ttl_seconds, save.overwrite) == ("ckpt1", 7200, False)
    named = roundtrip(
        requests.SaveWeightsForSamplerRequest,
        types.SaveWeightsForSamplerRequest(model_id="m", path="s1", seq_id=4),
    )
    assert named.path == "s1" and named.kind == "snapshot"
    ephemeral = roundtrip(
        requests.SaveWeightsForSamplerRequest,
        types.SaveWeightsForSamplerRequest(
            model_id="m", sampling_session_seq_id=0, kind="inflight", seq_id=5
        ),
    )
    assert ephemeral.sampling_session_seq_id == 0 and ephemeral.kind == "inflight"
    external = roundtrip(
        requests.SaveWeightsExternalRequest,
        types.SaveWeightsExternalRequest(
            model_id="m", path="x", seq_id=6, age_encryption_recipients=["age1x"]
        ),
    )
    assert external.age_encryption_recipients == ["age1x"]
    create = roundtrip(
        requests.LoadWeightsRequest,
        types.LoadWeightsRequest(
            session_id="s", model_seq_id=1, path="tinker://s:train:0/weights/c", optimizer=True
        ),
    )
    assert create.creates_model
    legacy = roundtrip(
        requests.LoadWeightsRequest,
        types.LoadWeightsRequest(
            model_id="s:train:0", seq_id=1, path="tinker://s:train:0/weights/c", optimizer=False
        ),
    )
    assert not legacy.creates_model


def test_sampling_bodies() -> None:
    session = roundtrip(
        requests.CreateSamplingSessionRequest,
        types.CreateSamplingSessionRequest(
            session_id="s", sampling_session_seq_id=0, model_path="tinker://s:train:0/sampler_weights/a"
        ),
    )
    assert session.model_path is not None
    for stop in (None, "\n", ["a", "b"], [1, 2], []):
        sdk = types.SampleRequest(
            num_samples=2,
            prompt=types.ModelInput.from_ints([1, 2, 3]),
            sampling_params=types.SamplingParams(max_tokens=3, stop=stop, temperature=0.7),
            sampling_session_id="s:sample:0",
            seq_id=0,
            prompt_logprobs=True,
        )
        body = roundtrip(requests.SampleRequest, sdk)
        assert body.sampling_params.stop == stop
        assert body.prompt.chunks[0].type == "encoded_text"
    target = types.SampleRequest(
        prompt=types.ModelInput.from_ints([1, 2]),
        sampling_params=types.SamplingParams(),
        sampling_session_id="s:sample:0",
        seq_id=1,
        target_prompt_logprobs={"data": [5], "dtype": "int64", "shape": [1, 1]},
    )
    assert roundtrip(requests.SampleRequest, target).target_prompt_logprobs is not None
    join = roundtrip(
        requests.JoinSamplingSessionRequest, types.JoinSamplingSessionRequest(sampling_session_id="x")
    )
    assert join.sampling_session_id == "x"


def test_image_chunks_parse_from_sdk_json() -> None:
    prompt = types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=3)])
    sdk = types.SampleRequest(
        prompt=prompt, sampling_params=types.SamplingParams(), sampling_session_id="s:sample:0", seq_id=0
    )
    body = roundtrip(requests.SampleRequest, sdk)
    assert body.prompt.chunks[0].type == "image"


def test_future_bodies() -> None:
    fut = roundtrip(
        control.FutureRetrieveRequest, types.FutureRetrieveRequest(request_id="r", allow_metadata_only=True)
    )
    assert fut.allow_metadata_only
    poll = roundtrip(
        control.FuturesRetrieveRequest,
        types.FuturesRetrieveRequest(
            target=types.SamplingSessionFuturesTarget(sampling_session_id="x", cloned_sampler_id=2),
            prev_cursor=3,
            timeout=0,
            retrieved_request_ids=["r"],
        ),
    )
    assert (poll.target.cloned_sampler_id, poll.prev_cursor, poll.timeout) == (2, 3, 0)
    assert parse_request(control.CancelFutureRequest, {"request_id": "r"}).request_id == "r"


def test_telemetry_and_custom_loss_bodies() -> None:
    now = datetime.now(UTC)
    events = [
        SessionStartEvent(
            event="SESSION_START", event_id="e1", event_session_index=0, severity="INFO", timestamp=now
        ),
        GenericEvent(
            event="GENERIC_EVENT",
            event_id="e2",
            event_name="x",
            event_session_index=1,
            severity="ERROR",
            timestamp=now,
            event_data={"a": [1, 2]},
        ),
    ]
    sdk = types.TelemetrySendRequest(
        events=events, platform="linux", sdk_version="0.38.0", session_id="s", process_uuid="p"
    )
    body = roundtrip(control.TelemetrySendRequest, sdk)
    assert body.events[1].event_data == {"a": [1, 2]}
    loss = types.CreateCustomLossRequest(
        session_id="s",
        custom_loss_seq_id=0,
        name="l",
        inputs=[types.CustomLossInput(name="logprobs", rank=1)],
        graph=types.CustomLossGraph(nodes=[types.CustomLossNode(op="placeholder", name="x", target="x")]),
    )
    assert roundtrip(requests.CreateCustomLossRequest, loss).graph.nodes[0].op == "placeholder"


def test_rest_bodies() -> None:
    copy = roundtrip(
        rest.CopyWeightsRequest,
        types.CopyWeightsRequest(destination_project_id="p", source_path="tinker://a:train:0/weights/x"),
    )
    assert copy.destination_project_id == "p"
    assert parse_request(rest.SetCheckpointTtlRequest, {"ttl_seconds": None}).ttl_seconds is None
    assert parse_request(rest.WeightsInfoRequest, {"tinker_path": "tinker://a/weights/b"}).tinker_path


def test_legacy_json_forward_backward_body() -> None:
    body = {
        "forward_backward_input": {
            "data": [
                {
                    "model_input": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
                    "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64", "shape": [2]}},
                }
            ],
            "loss_fn": "cross_entropy",
        },
        "model_id": "m",
        "seq_id": 1,
        "type": "forward_backward",
    }
    parsed = parse_request(requests.ForwardBackwardRequest, body)
    assert parsed.forward_backward_input.data[0].loss_fn_inputs["target_tokens"].data == [2, 3]


def test_unknown_keys_are_ignored() -> None:
    body = parse_request(requests.GetInfoRequest, {"model_id": "m", "type": "get_info", "future_field": 1})
    assert body.model_id == "m"


@pytest.mark.parametrize(
    ("model", "body", "field"),
    [
        (
            requests.CreateModelRequest,
            {"session_id": "s", "model_seq_id": 0, "base_model": "b", "lora_config": {"rank": 0}},
            "lora_config.rank",
        ),
        (
            requests.CreateModelRequest,
            {"session_id": "s", "model_seq_id": "0", "base_model": "b"},
            "model_seq_id",
        ),
        (
            requests.CreateModelRequest,
            {
                "session_id": "s",
                "model_seq_id": 0,
                "base_model": "b",
                "lora_config": {"rank": 8, "train_unembed": False, "train_mlp": False, "train_attn": False},
            },
            "lora_config",
        ),
        (requests.GetInfoRequest, {"model_id": "m", "type": "create_model"}, "type"),
        (
            requests.OptimStepRequest,
            {"model_id": "m", "seq_id": 1, "adam_params": {"beta1": 1.0}},
            "adam_params.beta1",
        ),
        (requests.OptimStepRequest, {"model_id": "m", "seq_id": 0, "adam_params": {}}, "seq_id"),
        (requests.SaveWeightsRequest, {"model_id": "m", "path": "a/b"}, "path"),
        (requests.SaveWeightsRequest, {"model_id": "m", "path": "..", "seq_id": 1}, "path"),
        (requests.SaveWeightsRequest, {"model_id": "m", "path": "a", "ttl_seconds": 60}, "ttl_seconds"),
        (requests.SaveWeightsForSamplerRequest, {"model_id": "m", "seq_id": 1}, "body"),
        (
            requests.SaveWeightsExternalRequest,
            {"model_id": "m", "path": "x", "age_encryption_recipients": ["k"] * 11},
            "age_encryption_recipients",
        ),
        (
            requests.LoadWeightsRequest,
            {
                "model_id": "m",
                "session_id": "s",
                "model_seq_id": 0,
                "path": "tinker://a/weights/b",
                "optimizer": True,
            },
            "body",
        ),
        (requests.LoadWeightsRequest, {"model_id": "m", "path": "/etc/passwd", "optimizer": True}, "path"),
        (requests.CreateSamplingSessionRequest, {"session_id": "s", "sampling_session_seq_id": 0}, "body"),
        (
            requests.SampleRequest,
            {"num_samples": 0, "prompt": {"chunks": []}, "sampling_params": {}, "base_model": "b"},
            "num_samples",
        ),
        (
            requests.SampleRequest,
            {"prompt": {"chunks": []}, "sampling_params": {"max_tokens": 0}, "base_model": "b"},
            "sampling_params.max_tokens",
        ),
        (
            requests.SampleRequest,
            {"prompt": {"chunks": []}, "sampling_params": {"top_p": 0}, "base_model": "b"},
            "sampling_params.top_p",
        ),
        (
            requests.SampleRequest,
            {"prompt": {"chunks": []}, "sampling_params": {}, "sampling_session_id": "x"},
            "body",
        ),
        (
            requests.SampleRequest,
            {"prompt": {"chunks": [{"type": "video"}]}, "sampling_params": {}, "base_model": "b"},
            "prompt.chunks[0]",
        ),
        (control.SessionHeartbeatRequest, {"session_id": ""}, "session_id"),
        (control.SessionHeartbeatRequest, {}, "session_id"),
        (
            requests.SampleRequest,
            {"prompt": {"chunks": [{"tokens": [1, 2**63]}]}, "sampling_params": {}, "base_model": "b"},
            "prompt.chunks[0].tokens[1]",
        ),
        (
            requests.SampleRequest,
            {"prompt": {"chunks": []}, "sampling_params": {"stop": ["a", 1]}, "base_model": "b"},
            "sampling_params.stop",
        ),
        (
            requests.OptimStepRequest,
            {"model_id": "m", "seq_id": 1, "adam_params": {"learning_rate": "1"}},
            "adam_params.learning_rate",
        ),
    ],
)
def test_invalid_bodies_name_the_field(
    model: type[pydantic.BaseModel], body: dict[str, Any], field: str
) -> None:
    with pytest.raises(WireError) as err:
        parse_request(model, body)
    assert err.value.field == field, err.value


def test_parse_request_rejects_non_objects_and_keeps_ids() -> None:
    with pytest.raises(WireError, match="not valid JSON"):
        parse_request(requests.GetInfoRequest, b"{")
    with pytest.raises(WireError, match="JSON object"):
        parse_request(requests.GetInfoRequest, b"[1]")
    with pytest.raises(WireError) as err:
        parse_request(requests.OptimStepRequest, {"model_id": "m", "seq_id": 7, "adam_params": {"eps": -1}})
    assert (err.value.model_id, err.value.seq_id) == ("m", 7)
    assert "greater than or equal to 0 (got -1)" in err.value.message
    assert err.value.to_detail()["field"] == err.value.field


def test_chunk_without_type_is_a_token_run() -> None:
    chunks = parse_request(inputs.ModelInput, {"chunks": [{"tokens": [1, 2]}]}).chunks
    assert isinstance(chunks[0], inputs.EncodedTextChunk)
