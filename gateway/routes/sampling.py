"""Sampling endpoints of the Tinker API: create_sampling_session, samplers/{id}, join_sampling_session,
asample.

A sampling session is pinned to base weights or a `tinker://` checkpoint at creation; `asample`
answers a future whose `sample_sequence_ids` (one per requested sample, protocol §0.4) come from the
control plane, and whose result is a protobuf `SampleResponse`. Sampling requests are independent (no
seq_id ordering); the control plane dedupes `(sampling_session_id, seq_id)` and may answer 429 with
`Retry-After` for backpressure, which the SDK honours by resubmitting the same seq_id.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.deps import Control, CurrentTenant, RawBody, RenderCache, SettingsDep, documents_body, parse_body
from gateway.rendering import SampleRenderOptions, wire_json
from services.db.ids import SamplingSessionId, SessionId
from services.wire import WireError, sample_work
from services.wire.requests import CreateSamplingSessionRequest, JoinSamplingSessionRequest, SampleRequest
from services.wire.responses import (
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    JoinSamplingSessionResponse,
    UntypedAPIFuture,
)

router = APIRouter(prefix="/api/v1", tags=["sampling"])


@router.post("/create_sampling_session", response_model=CreateSamplingSessionResponse)
@documents_body(CreateSamplingSessionRequest)
async def create_sampling_session(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """Sampling session `{session_id}:sample:{sampling_session_seq_id}` on a base model or checkpoint."""
    request = parse_body(CreateSamplingSessionRequest, body)
    sampling_session_id = await control.create_sampling_session(
        tenant, SessionId(request.session_id), request.sampling_session_seq_id,
        model_path=request.model_path, base_model=request.base_model,
    )
    return wire_json(CreateSamplingSessionResponse(sampling_session_id=sampling_session_id))


@router.get("/samplers/{sampler_id:path}", response_model=GetSamplerResponse)
async def get_sampler(sampler_id: str, tenant: CurrentTenant, control: Control) -> JSONResponse:
    """What a sampling session samples (`base_model`, and `model_path` unless it is the base model)."""
    base_model, model_path = await control.get_sampler(tenant, SamplingSessionId(sampler_id))
    return wire_json(GetSamplerResponse(sampler_id=sampler_id, base_model=base_model, model_path=model_path))


@router.post("/join_sampling_session")
@documents_body(JoinSamplingSessionRequest)
async def join_sampling_session(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """An unpickled `SamplingClient` joins its sampling session: a fresh clone id (its seq ids then start at
    `clone * 10**9`, and `retrieve_futures` polls that clone alone)."""
    request = parse_body(JoinSamplingSessionRequest, body)
    counter = await control.join_sampling_session(tenant, SamplingSessionId(request.sampling_session_id))
    return wire_json(JoinSamplingSessionResponse(client_counter=counter))


@router.post("/asample", response_model=UntypedAPIFuture)
@documents_body(SampleRequest)
async def asample(
    tenant: CurrentTenant, control: Control, settings: SettingsDep, render: RenderCache, body: RawBody
) -> JSONResponse:
    """Sample `num_samples` continuations of a prompt; result: `SampleResponse` (protobuf)."""
    request = parse_body(SampleRequest, body)
    if request.sampling_session_id is None:
        raise WireError(
            "sampling_session_id", "is required: create a sampling session first (create_sampling_session)"
        )
    work = sample_work(request, None, default_max_tokens=settings.default_max_tokens)
    submitted = await control.sample(tenant, SamplingSessionId(request.sampling_session_id), request.seq_id, work)
    render.remember(
        submitted.request_id,
        SampleRenderOptions(request.topk_prompt_logprobs, request.prompt_logprobs_last_n),
    )
    return wire_json(
        UntypedAPIFuture(request_id=submitted.request_id, sample_sequence_ids=submitted.sample_sequence_ids)
    )
