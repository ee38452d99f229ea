"""Contract: every wire model that mirrors an SDK type has the SDK type's field names, field for field.

Documented exceptions (EXCEPTIONS below) are the only allowed differences; a new SDK field or a renamed
one of ours fails this test, so the models are revisited whenever the SDK pin moves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pydantic
import pytest
import tinker.types._pydantic_types.forward_backward_input as sdk_pyd_fb_input
import tinker.types._pydantic_types.tensor_data as sdk_pyd_tensor
from tinker import types
from tinker.lib.public_interfaces.rest_client import _SessionTraceExportPollResponse
from tinker.types.optimizer import OptimizerConfigBase, OptimParamsBase
from tinker.types.try_again_response import TryAgainResponse

from services.wire import admin, control, inputs, requests, responses, rest, results

MIRRORS: list[tuple[type, type]] = [
    # inputs
    (inputs.TensorData, sdk_pyd_tensor.TensorData),
    (inputs.EncodedTextChunk, types.EncodedTextChunk),
    (inputs.ImageChunk, types.ImageChunk),
    (inputs.ImageAssetPointerChunk, types.ImageAssetPointerChunk),
    (inputs.DmelChunk, types.DmelChunk),
    (inputs.ModelInput, types.ModelInput),
    (inputs.Datum, types.Datum),
    (inputs.ForwardBackwardInput, sdk_pyd_fb_input.ForwardBackwardInput),
    (inputs.LoraConfig, types.LoraConfig),
    (inputs.OptimizerConfigBase, OptimizerConfigBase),
    (inputs.AdamParams, types.AdamParams),
    (inputs.OptimParamsBase, OptimParamsBase),
    (inputs.SamplingParams, types.SamplingParams),
    # control
    (control.ClientConfigRequest, types.ClientConfigRequest),
    (control.CreateSessionRequest, types.CreateSessionRequest),
    (control.SessionHeartbeatRequest, types.SessionHeartbeatRequest),
    (control.SessionFinishRequest, types.ClientSessionFinished),
    (control.FutureRetrieveRequest, types.FutureRetrieveRequest),
    (control.SamplingSessionFuturesTarget, types.SamplingSessionFuturesTarget),
    (control.FuturesRetrieveRequest, types.FuturesRetrieveRequest),
    (control.TelemetrySendRequest, types.TelemetrySendRequest),
    # requests
    (requests.CreateModelRequest, types.CreateModelRequest),
    (requests.GetInfoRequest, types.GetInfoRequest),
    (requests.UnloadModelRequest, types.UnloadModelRequest),
    (requests.ForwardBackwardRequest, types.ForwardBackwardRequest),
    (requests.ForwardRequest, types.ForwardRequest),
    (requests.OptimStepRequest, types.OptimStepRequest),
    (requests.SaveWeightsRequest, types.SaveWeightsRequest),
    (requests.SaveWeightsForSamplerRequest, types.SaveWeightsForSamplerRequest),
    (requests.SaveWeightsExternalRequest, types.SaveWeightsExternalRequest),
    (requests.LoadWeightsRequest, types.LoadWeightsRequest),
    (requests.CreateSamplingSessionRequest, types.CreateSamplingSessionRequest),
    (requests.JoinSamplingSessionRequest, types.JoinSamplingSessionRequest),
    (requests.SampleRequest, types.SampleRequest),
    (requests.CustomLossInput, types.CustomLossInput),
    (requests.CustomLossNode, types.CustomLossNode),
    (requests.CustomLossGraph, types.CustomLossGraph),
    (requests.CreateCustomLossRequest, types.CreateCustomLossRequest),
    # responses
    (responses.ClientConfigResponse, types.ClientConfigResponse),
    (responses.ClientDynamicConfigResponse, types.ClientDynamicConfigResponse),
    (responses.CreateSessionResponse, types.CreateSessionResponse),
    (responses.SessionHeartbeatResponse, types.SessionHeartbeatResponse),
    (responses.TelemetryResponse, types.TelemetryResponse),
    (responses.AuthTokenResponse, types.AuthTokenResponse),
    (responses.UntypedAPIFuture, types.UntypedAPIFuture),
    (responses.TryAgainResponse, TryAgainResponse),
    (responses.RequestFailedResponse, types.RequestFailedResponse),
    (responses.CreateModelResponse, types.CreateModelResponse),
    (responses.ModelData, types.ModelData),
    (responses.GetInfoResponse, types.GetInfoResponse),
    (responses.OptimStepResponse, types.OptimStepResponse),
    (responses.SaveWeightsResponse, types.SaveWeightsResponse),
    (responses.SaveWeightsForSamplerResponseInternal, types.SaveWeightsForSamplerResponseInternal),
    (responses.SaveWeightsExternalResponseInternal, types.SaveWeightsExternalResponseInternal),
    (responses.LoadWeightsResponse, types.LoadWeightsResponse),
    (responses.UnloadModelResponse, types.UnloadModelResponse),
    (responses.CreateCustomLossResponse, types.CreateCustomLossResponse),
    (responses.CreateSamplingSessionResponse, types.CreateSamplingSessionResponse),
    (responses.GetSamplerResponse, types.GetSamplerResponse),
    (responses.JoinSamplingSessionResponse, types.JoinSamplingSessionResponse),
    (responses.FutureFinished, types.FutureFinished),
    (responses.FutureFailed, types.FutureFailed),
    (responses.FuturesRetrieveResponse, types.FuturesRetrieveResponse),
    # rest
    (rest.CopyWeightsRequest, types.CopyWeightsRequest),
    (rest.Cursor, types.Cursor),
    (rest.Checkpoint, types.Checkpoint),
    (rest.TrainingRun, types.TrainingRun),
    (rest.TrainingRunsResponse, types.TrainingRunsResponse),
    (rest.CheckpointsListResponse, types.CheckpointsListResponse),
    (rest.SupportedModel, types.SupportedModel),
    (rest.GetServerCapabilitiesResponse, types.GetServerCapabilitiesResponse),
    (rest.HealthResponse, types.HealthResponse),
    (rest.WeightsInfoResponse, types.WeightsInfoResponse),
    (rest.ExternalWeightsUrlsResponse, types.ExternalWeightsUrlsResponse),
    (rest.CopyWeightsResponse, types.CopyWeightsResponse),
    (rest.ListSessionsResponse, types.ListSessionsResponse),
    (rest.GetSessionResponse, types.GetSessionResponse),
    (rest.SessionTraceExportResponse, _SessionTraceExportPollResponse),
    # session search and AdminClient
    (admin.SessionSearchRequest, types.SessionSearchRequest),
    (admin.SessionSearchCursor, types.SessionSearchCursor),
    (admin.SessionSearchResponse, types.SessionSearchResponse),
    (admin.SessionSummary, types.SessionSummary),
    (admin.AuditLogEntry, types.AuditLogEntry),
    (admin.AuditLogResponse, types.AuditLogResponse),
    (admin.BillingUsageEvent, types.BillingUsageEvent),
    (admin.BillingUsageResponse, types.BillingUsageResponse),
    (admin.CurrentCheckpointStorageUsageItem, types.CurrentCheckpointStorageUsageItem),
    (admin.CurrentCheckpointStorageUsageResponse, types.CurrentCheckpointStorageUsageResponse),
    # proto-typed results (SDK dataclasses)
    (results.ForwardBackwardOutput, types.ForwardBackwardOutput),
    (results.SampleResponse, types.SampleResponse),
    (results.SampledSequence, types.SampledSequence),
    (results.TopkLogprobs, types.topk_logprobs.TopkLogprobs),
    (results.PromptAltTokens, types.PromptAltTokens),
]

# (ours, field) → why it differs. "+" = only ours has it, "-" = only the SDK has it.
EXCEPTIONS: dict[tuple[type, str], str] = {
    # The SDK sends {"reason", "detail"}; `type` is only on its status model, never on the wire.
    (control.SessionFinishRequest, "-type"): "not sent by the SDK's finish call",
    # Sent by the server alongside try_again; the SDK reads it from the raw dict before validating.
    (responses.TryAgainResponse, "+queue_state_reason"): "logged by the SDK from the raw answer",
    # Stamped client-side from the promise's sample_sequence_ids; not on the wire.
    (results.SampledSequence, "-sequence_id"): "set by the SDK after decoding",
}


def field_names(cls: type) -> set[str]:
    """Public field names of a pydantic model or a dataclass (private `_x` storage excluded)."""
    if isinstance(cls, type) and issubclass(cls, pydantic.BaseModel):
        return set(cls.model_fields)
    return {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}


@pytest.mark.parametrize(("ours", "sdk"), MIRRORS, ids=lambda c: getattr(c, "__qualname__", str(c)))
def test_field_names_match_sdk(ours: type, sdk: type) -> None:
    mine, theirs = field_names(ours), field_names(sdk)
    allowed_extra = {k[1][1:] for k in EXCEPTIONS if k[0] is ours and k[1].startswith("+")}
    allowed_missing = {k[1][1:] for k in EXCEPTIONS if k[0] is ours and k[1].startswith("-")}
    assert mine - theirs == allowed_extra, f"{ours.__name__} has fields the SDK lacks"
    assert theirs - mine == allowed_missing, f"{ours.__name__} lacks SDK fields"


def test_names_are_the_sdk_names() -> None:
    renamed = {
        control.SessionFinishRequest: "ClientSessionFinished",
        rest.SessionTraceExportResponse: "_SessionTraceExportPollResponse",
    }
    for ours, sdk in MIRRORS:
        assert renamed.get(ours, ours.__name__) == sdk.__name__


def test_every_sdk_request_type_has_a_mirror() -> None:
    mirrored: set[Any] = {sdk for _, sdk in MIRRORS}
    request_types = [
        getattr(types, name)
        for name in dir(types)
        if name.endswith("Request") and isinstance(getattr(types, name), type)
    ]
    # Query parameters of the two billing GETs (FastAPI `Query`s in gateway/routes/admin.py), not bodies.
    unserved = {"GetBillingUsageRequest", "GetCurrentCheckpointStorageUsageRequest"}
    missing = [t.__name__ for t in request_types if t not in mirrored and t.__name__ not in unserved]
    assert missing == []
