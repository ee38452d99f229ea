"""REST for hub pushes: `POST/GET /v1/hub_pushes`, `GET /v1/hub_pushes/{id}`, `POST /v1/hub_pushes/{id}/retry`,
`PUT/DELETE /v1/hub_credentials/{hub}`.

A push is accepted with 202 and runs in the background (Celery in cluster mode, threads in `carpool
serve`); poll `GET /v1/hub_pushes/{id}` for queued → running → done|failed. Tokens go in once and never
come back out: the credential routes answer without them. A failed push can be retried (202, queued
again); retrying one in any other state answers 409 naming that state (these routes are not the SDK's,
so 409 is safe: nothing retries it blindly).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from gateway.deps import CurrentTenant
from gateway.errors import ApiError
from services.hub.service import HubPushService, NewPush, NotRetryable, PushView

router = APIRouter(prefix="/v1", tags=["hub"])


async def hub_service(request: Request) -> HubPushService:
    service = getattr(request.app.state, "hub", None)
    if service is None:
        raise ApiError(503, "hub pushes are not configured on this server")
    return service  # type: ignore[no-any-return]


Hub = Annotated[HubPushService, Depends(hub_service)]


class HubPushRequest(BaseModel):
    """Push one of your checkpoints (its PEFT adapter and a model card) to a hub repo."""

    model_config = ConfigDict(extra="forbid")

    tinker_path: str = Field(description="The checkpoint, `tinker://<run>/weights/<name>` (or sampler_weights)")
    hub: str = Field(description="`huggingface` or `modelscope`")
    repo_id: str = Field(description="`namespace/name`; created if missing")
    private: bool = Field(True, description="Create the repo private (an existing repo keeps its visibility)")
    revision: str | None = Field(None, description="Branch to commit to; default: the repo's main branch")
    commit_message: str | None = Field(None, description="Default: `Upload LoRA adapter <tinker_path>`")


class HubPush(BaseModel):
    id: int
    tinker_path: str
    hub: str
    repo_id: str
    private: bool
    revision: str | None = None
    status: Literal["queued", "running", "done", "failed"]
    error: str | None = None
    """When failed: what went wrong (after how many attempts)."""
    attempts: int
    hub_revision: str | None = None
    """When done: the commit on the hub."""
    url: str | None = None
    created_at: datetime
    finished_at: datetime | None = None


class HubPushList(BaseModel):
    hub_pushes: list[HubPush]
    total_count: int
    limit: int
    offset: int


class HubCredential(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: str = Field(description="A write token of the hub account that owns the repos (stored encrypted)")


def _push(view: PushView) -> HubPush:
    return HubPush(**view.__dict__)


@router.post("/hub_pushes", status_code=202, response_model=HubPush, summary="Push a checkpoint to a hub")
async def create_hub_push(body: HubPushRequest, tenant: CurrentTenant, hub: Hub) -> JSONResponse:
    view = await hub.create(tenant, NewPush(**body.model_dump()))
    return JSONResponse(_push(view).model_dump(mode="json"), status_code=202)


@router.get("/hub_pushes", response_model=HubPushList, summary="List your hub pushes, newest first")
async def list_hub_pushes(
    tenant: CurrentTenant, hub: Hub,
    limit: Annotated[int, Query(description="Page size (1-100)")] = 20,
    offset: Annotated[int, Query(description="Pushes to skip")] = 0,
) -> HubPushList:
    views, total = await hub.list_pushes(tenant, limit, offset)
    return HubPushList(hub_pushes=[_push(v) for v in views], total_count=total, limit=limit, offset=offset)


PushId = Annotated[int, Path(ge=1, le=2**63 - 1, description="The push's id (a positive 64-bit integer)")]


@router.get("/hub_pushes/{push_id}", response_model=HubPush, summary="Get a hub push")
async def get_hub_push(push_id: PushId, tenant: CurrentTenant, hub: Hub) -> HubPush:
    return _push(await hub.get(tenant, push_id))


@router.post("/hub_pushes/{push_id}/retry", status_code=202, response_model=HubPush,
             summary="Retry a failed hub push", responses={409: {"description": "The push is not failed"}})
async def retry_hub_push(push_id: PushId, tenant: CurrentTenant, hub: Hub) -> JSONResponse:
    try:
        view = await hub.retry(tenant, push_id)
    except NotRetryable as exc:
        raise ApiError(409, exc.message, field="status") from exc
    return JSONResponse(_push(view).model_dump(mode="json"), status_code=202)


@router.put("/hub_credentials/{hub_name}", status_code=204, summary="Store your token for a hub")
async def put_hub_credential(hub_name: str, body: HubCredential, tenant: CurrentTenant, hub: Hub) -> Response:
    await hub.put_credential(tenant, hub_name, body.token)
    return Response(status_code=204)


@router.delete("/hub_credentials/{hub_name}", status_code=204, summary="Forget your token for a hub")
async def delete_hub_credential(hub_name: str, tenant: CurrentTenant, hub: Hub) -> Response:
    await hub.delete_credential(tenant, hub_name)
    return Response(status_code=204)
