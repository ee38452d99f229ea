"""Plain REST (`/v1/...`) for clients without the Tinker SDK: the core operations, JSON only.

Bodies are the Tinker JSON request bodies (documented in the OpenAPI schema at `/docs`), with the same
validation, errors and seq_id rules: training requests of one model carry consecutive `seq_id`s from 1
and run in that order. Most routes are the Tinker handlers mounted at resource-style paths;
what differs is reading futures: `GET /v1/futures/{request_id}?wait=<s>` answers one JSON envelope
(`status` pending / done / failed, and the result as JSON, never protobuf).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from gateway.deps import Control, CurrentTenant, RenderCache, SettingsDep
from gateway.rendering import failed_payload, payload_json, safe_result_payload
from gateway.routes import futures, sampling, service, training, weights
from services.control.api import Done, Failed, Pending
from services.db.ids import RequestId
from services.wire.responses import (
    CreateSamplingSessionResponse,
    CreateSessionResponse,
    GetInfoResponse,
    UntypedAPIFuture,
)
from services.wire.rest import CheckpointsListResponse, TrainingRun, TrainingRunsResponse

router = APIRouter(prefix="/v1", tags=["rest"])


def _mount(method: str, path: str, endpoint: Callable[..., Any], response_model: type[BaseModel] | None,
           summary: str) -> None:
    router.add_api_route(path, endpoint, methods=[method], response_model=response_model, summary=summary)


_mount("POST", "/sessions", service.create_session, CreateSessionResponse, "Create a session")
_mount("POST", "/models", training.create_model, UntypedAPIFuture, "Create a LoRA training run (future)")
_mount("POST", "/forward_backward", training.forward_backward, UntypedAPIFuture,
       "Forward + backward on JSON datums (future)")
_mount("POST", "/forward", training.forward, UntypedAPIFuture, "Forward only on JSON datums (future)")
_mount("POST", "/optim_step", training.optim_step, UntypedAPIFuture, "AdamW step (future)")
_mount("POST", "/save_weights", weights.save_weights, UntypedAPIFuture, "Save weights + optimizer (future)")
_mount("POST", "/save_weights_for_sampler", weights.save_weights_for_sampler, UntypedAPIFuture,
       "Save sampler weights (future)")
_mount("POST", "/save_weights_external", weights.save_weights_external, UntypedAPIFuture,
       "Export PEFT weights for download (future)")
_mount("POST", "/load_weights", weights.load_weights, UntypedAPIFuture, "Load a checkpoint (future)")
_mount("POST", "/sampling_sessions", sampling.create_sampling_session, CreateSamplingSessionResponse,
       "Create a sampling session")
_mount("POST", "/sample", sampling.asample, UntypedAPIFuture, "Sample from a sampling session (future)")
_mount("GET", "/training_runs", weights.list_training_runs, TrainingRunsResponse, "List training runs")
_mount("GET", "/training_runs/{training_run_id}", weights.get_training_run, TrainingRun, "Get a training run")
_mount("GET", "/training_runs/{training_run_id}/checkpoints", weights.list_run_checkpoints,
       CheckpointsListResponse, "List a run's checkpoints")
_mount("GET", "/checkpoints", weights.list_user_checkpoints, CheckpointsListResponse, "List all checkpoints")


@router.post("/futures/{request_id}/cancel", response_model=futures.CancelledFuture, summary="Cancel a future")
async def cancel_future(request_id: str, tenant: CurrentTenant, control: Control) -> JSONResponse:
    """Abandon a request (best effort: one already running finishes). The path names it; a body is ignored
    (the Tinker route reads the id from its body, which here would let path and body disagree)."""
    await control.cancel(tenant, RequestId(request_id))
    return JSONResponse(futures.CancelledFuture(request_id=request_id).model_dump())


@router.get("/models/{model_id}", response_model=GetInfoResponse, summary="Get a training run's model info")
async def get_model(model_id: str, tenant: CurrentTenant, control: Control) -> JSONResponse:
    return await training.model_info_response(tenant, control, model_id)


class FutureStatus(BaseModel):
    """The state of a future, for REST clients."""

    request_id: str
    status: Literal["pending", "done", "failed"]
    kind: str | None = None
    """Request kind (`forward_backward`, `sample`, ...) once done."""
    queue_state: str | None = None
    """While pending: `active`, `paused_capacity` or `paused_rate_limit`."""
    result: dict[str, Any] | None = None
    """When done: the result as JSON (tensors as `{"data", "dtype", "shape"}`)."""
    error: str | None = None
    """When failed: what went wrong."""
    category: str | None = None
    """When failed: `user` (bad input) or `server`."""


@router.get("/futures/{request_id}", response_model=FutureStatus, summary="Get (or wait for) a future")
async def get_future(
    request_id: str, tenant: CurrentTenant, control: Control, settings: SettingsDep, render: RenderCache,
    wait: Annotated[float, Query(ge=0, description="Seconds to wait for completion (capped by the server)")] = 0,
) -> JSONResponse:
    state = await control.retrieve(tenant, RequestId(request_id), min(wait, settings.long_poll_seconds))
    if isinstance(state, Pending):
        answer = FutureStatus(request_id=request_id, status="pending", queue_state=state.queue_state)
    elif isinstance(state, Failed):
        failed = failed_payload(state)
        answer = FutureStatus(request_id=request_id, status="failed", error=failed.error, category=failed.category)
    else:
        assert isinstance(state, Done)
        answer = _done_status(request_id, state, render)
    return JSONResponse(answer.model_dump(mode="json", exclude_none=True))


def _done_status(request_id: str, done: Done, render: RenderCache) -> FutureStatus:
    body = payload_json(safe_result_payload(request_id, done, render.get(request_id)))
    if "error" in body:  # the result could not be rendered
        return FutureStatus(request_id=request_id, status="failed", error=body["error"],
                            category=body.get("category"))
    return FutureStatus(request_id=request_id, status="done", kind=done.kind, result=body)


@router.get("/usage", summary="The caller's usage counters")
async def usage(tenant: CurrentTenant, control: Control) -> JSONResponse:
    """Metered usage of the caller (tokens trained / sampled, ...), as the control plane counts it."""
    return JSONResponse({"tenant": tenant.name, "usage": await control.usage(tenant)})
