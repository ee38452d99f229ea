"""Our JSON answers, serialized as the gateway will (`model_dump(mode="json")`), validate as the SDK's
own response types; and the raw-dict answers of `retrieve_future` are classified as the SDK does."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pydantic
import pytest
from tinker import types
from tinker.lib.public_interfaces.rest_client import _SessionTraceExportPollResponse
from tinker.types.try_again_response import TryAgainResponse as SdkTryAgainResponse

from services.wire import responses as r
from services.wire import rest
from services.wire.results import ForwardBackwardOutput, SampledSequence, SampleResponse

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
CHECKPOINT = rest.Checkpoint(
    checkpoint_id="weights/c1",
    checkpoint_type="training",
    time=NOW,
    tinker_path="tinker://s:train:0/weights/c1",
    size_bytes=10,
    user_metadata={"a": "b"},
)

PAIRS: list[tuple[pydantic.BaseModel, type[pydantic.BaseModel]]] = [
    (r.ClientConfigResponse(), types.ClientConfigResponse),
    (r.ClientDynamicConfigResponse(), types.ClientDynamicConfigResponse),
    (r.CreateSessionResponse(session_id="s", warning_message="upgrade"), types.CreateSessionResponse),
    (r.SessionHeartbeatResponse(), types.SessionHeartbeatResponse),
    (r.TelemetryResponse(), types.TelemetryResponse),
    (r.AuthTokenResponse(jwt="eyJ"), types.AuthTokenResponse),
    (r.UntypedAPIFuture(request_id="r", sample_sequence_ids=["r:0"]), types.UntypedAPIFuture),
    (r.TryAgainResponse(request_id="r"), SdkTryAgainResponse),
    (r.RequestFailedResponse(error="bad", category="user"), types.RequestFailedResponse),
    (r.CreateModelResponse(model_id="s:train:0"), types.CreateModelResponse),
    (
        r.GetInfoResponse(
            model_id="m", model_data=r.ModelData(arch="qwen3", model_name="Q", tokenizer_id="Q"), lora_rank=8
        ),
        types.GetInfoResponse,
    ),
    (r.OptimStepResponse(metrics={"grad_norm:mean": 1.0}), types.OptimStepResponse),
    (r.OptimStepResponse(), types.OptimStepResponse),
    (r.SaveWeightsResponse(path="tinker://m/weights/a"), types.SaveWeightsResponse),
    (
        r.SaveWeightsForSamplerResponseInternal(sampling_session_id="s:sample:0"),
        types.SaveWeightsForSamplerResponseInternal,
    ),
    (
        r.SaveWeightsExternalResponseInternal(path="tinker://m/external_weights/a", size_bytes=3),
        types.SaveWeightsExternalResponseInternal,
    ),
    (r.LoadWeightsResponse(path="p", model_id="m"), types.LoadWeightsResponse),
    (r.UnloadModelResponse(model_id="m"), types.UnloadModelResponse),
    (r.CreateCustomLossResponse(loss_id="l"), types.CreateCustomLossResponse),
    (r.CreateSamplingSessionResponse(sampling_session_id="s:sample:0"), types.CreateSamplingSessionResponse),
    (r.GetSamplerResponse(sampler_id="x", base_model="b"), types.GetSamplerResponse),
    (r.JoinSamplingSessionResponse(client_counter=1), types.JoinSamplingSessionResponse),
    (
        r.FuturesRetrieveResponse(
            completions=[
                r.FutureFinished(request_id="a", response_payload_uncompressed_size=5),
                r.FutureFailed(request_id="b"),
            ],
            cursor=2,
        ),
        types.FuturesRetrieveResponse,
    ),
    (
        rest.TrainingRunsResponse(
            training_runs=[
                rest.TrainingRun(
                    training_run_id="s:train:0",
                    base_model="b",
                    model_owner="o",
                    is_lora=True,
                    lora_rank=8,
                    last_request_time=NOW,
                    last_checkpoint=CHECKPOINT,
                )
            ],
            cursor=rest.Cursor(offset=0, limit=20, total_count=1),
        ),
        types.TrainingRunsResponse,
    ),
    (rest.CheckpointsListResponse(checkpoints=[CHECKPOINT]), types.CheckpointsListResponse),
    (
        rest.GetServerCapabilitiesResponse(
            supported_models=[rest.SupportedModel(model_name="b", trainable=True)]
        ),
        types.GetServerCapabilitiesResponse,
    ),
    (rest.HealthResponse(), types.HealthResponse),
    (
        rest.WeightsInfoResponse(base_model="b", is_lora=True, lora_rank=8, train_mlp=True),
        types.WeightsInfoResponse,
    ),
    (
        rest.ExternalWeightsUrlsResponse(urls={"a.safetensors": "http://x"}, expires=NOW),
        types.ExternalWeightsUrlsResponse,
    ),
    (rest.CopyWeightsResponse(tinker_path="tinker://x/weights/y"), types.CopyWeightsResponse),
    (rest.ListSessionsResponse(sessions=["s"]), types.ListSessionsResponse),
    (rest.GetSessionResponse(training_run_ids=["s:train:0"], sampler_ids=[]), types.GetSessionResponse),
    (rest.SessionTraceExportResponse(status="ready", url="http://x"), _SessionTraceExportPollResponse),
]


@pytest.mark.parametrize(
    ("ours", "sdk"), PAIRS, ids=lambda v: type(v).__name__ if isinstance(v, pydantic.BaseModel) else ""
)
def test_sdk_validates_our_answer(ours: pydantic.BaseModel, sdk: type[pydantic.BaseModel]) -> None:
    text = json.dumps(ours.model_dump(mode="json"))
    parsed = sdk.model_validate_json(text, strict=True)
    for name, value in ours.model_dump(mode="json").items():
        if name in type(parsed).model_fields and value is not None:
            assert json.loads(json.dumps(parsed.model_dump(mode="json")[name])) == value, name


def sdk_classify(answer: dict[str, object]) -> str:
    """The order `tinker/lib/api_future_impl.py::_fetch_via_rest` checks a JSON answer in."""
    if answer.get("type") == "try_again":
        return "try_again"
    if answer.get("status") == "complete_metadata":
        return "metadata"
    if "error" in answer:
        return "failed"
    return "success"


def test_future_answers_are_classified_like_the_sdk() -> None:
    assert sdk_classify(r.TryAgainResponse(request_id="r").model_dump(mode="json")) == "try_again"
    assert (
        sdk_classify(r.CompleteMetadataResponse(response_payload_size=9).model_dump(mode="json"))
        == "metadata"
    )
    assert (
        sdk_classify(r.RequestFailedResponse(error="x", category="server").model_dump(mode="json"))
        == "failed"
    )
    assert sdk_classify(r.CreateModelResponse(model_id="m").model_dump(mode="json")) == "success"
    assert (
        types.RequestErrorCategory(r.RequestFailedResponse(error="x").category)
        is types.RequestErrorCategory.User
    )


def test_responses_refuse_unknown_fields_and_need_required_ones() -> None:
    with pytest.raises(pydantic.ValidationError):
        r.UntypedAPIFuture(request_id="r", bogus=1)  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError):
        r.GetInfoResponse(model_id="m")  # type: ignore[call-arg]


def test_legacy_json_results_validate_as_old_sdk_shapes() -> None:
    import numpy as np

    fb = ForwardBackwardOutput(
        loss_fn_outputs=[{"logprobs": np.array([-1.0], np.float32)}], metrics={"loss:sum": 1.0}
    )
    legacy = fb.to_json_dict()
    assert legacy["loss_fn_outputs"][0]["logprobs"] == {"data": [-1.0], "dtype": "float32", "shape": [1]}
    sample = SampleResponse(
        sequences=[SampledSequence(stop_reason="stop", tokens_np=np.array([1, 2]))],
        prompt_logprobs_np=np.array([np.nan, -0.5], np.float32),
    ).to_json_dict()
    assert sample["prompt_logprobs"] == [None, -0.5]
    assert sample["sequences"][0] == {"stop_reason": "stop", "tokens": [1, 2], "logprobs": None}
