"""Checkpoint endpoints: the save/load futures of a training run, and the REST side of checkpoints.

Futures (ordered by seq_id like every training request, guarded by `SeqIdGuard`): `save_weights`
(`save_state`, `weights/<name>`), `save_weights_for_sampler` (named `sampler_weights/<name>`, or an
ephemeral sampler snapshot that answers a `sampling_session_id`), `save_weights_external` (a PEFT export
under `external_weights/<name>`, every file age-encrypted to `<file>.age` when the request names
`age_encryption_recipients`), `load_weights` (create-via-load or the legacy in-place load).

REST (direct JSON answers, for `tinker.RestClient`): training runs, a run's checkpoints and the caller's
checkpoints, delete / publish / unpublish / TTL, `weights_info`, signed `external_weights_urls`, and the
download route those URLs point at — `GET /api/v1/download/{token}`, where the signed token is the
credential (no API key). Checkpoint ids contain `/` (`weights/ckpt1`) and run ids `:`, hence the
`path` converters.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from gateway.deps import Auth, Control, CurrentTenant, PublicBaseUrl, RawBody, documents_body, parse_body
from gateway.errors import ApiError, SeqIdGuard
from gateway.rendering import wire_json
from gateway.routes.training import require_seq_id
from services.control.api import CheckpointKindName, CheckpointView, Page, SaveOptions, TrainingRunView
from services.control.training import ExternalSaveOptions
from services.db.ids import ModelId, SessionId
from services.wire import WireError, check_optimizer_config
from services.wire.paths import parse_checkpoint_id
from services.wire.requests import (
    LoadWeightsRequest,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
)
from services.wire.responses import UntypedAPIFuture
from services.wire.rest import (
    DEFAULT_CHECKPOINTS_LIMIT,
    DEFAULT_RUNS_LIMIT,
    AccessScope,
    Checkpoint,
    CheckpointsListResponse,
    CopyWeightsRequest,
    CopyWeightsResponse,
    Cursor,
    ExternalWeightsUrlsResponse,
    SetCheckpointTtlRequest,
    TrainingRun,
    TrainingRunsResponse,
    WeightsInfoRequest,
    WeightsInfoResponse,
)

router = APIRouter(prefix="/api/v1", tags=["weights"])

MAX_PAGE = 1000
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="Page size")]
Offset = Annotated[int, Query(ge=0, le=2**31 - 1, description="Items to skip")]


# -- futures ------------------------------------------------------------------------------------


async def _submit_save(
    tenant: CurrentTenant, control: Control, guard: SeqIdGuard, model_id: str, seq_id: int | None,
    kind: CheckpointKindName, options: SaveOptions, sampling_session_seq_id: int | None = None,
) -> JSONResponse:
    guard.track(model_id, seq_id)
    checked_seq_id = require_seq_id(seq_id)
    submitted = await control.save(
        tenant, ModelId(model_id), checked_seq_id, kind, options, sampling_session_seq_id
    )
    return wire_json(UntypedAPIFuture(request_id=submitted.request_id, model_id=model_id))


@router.post("/save_weights", response_model=UntypedAPIFuture)
@documents_body(SaveWeightsRequest)
async def save_weights(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """`save_state`: weights + optimizer under `weights/<path>`; result: `SaveWeightsResponse`."""
    async with SeqIdGuard(control, tenant) as guard:
        request = parse_body(SaveWeightsRequest, body)
        guard.track(request.model_id, request.seq_id)
        if request.path is None:
            raise WireError("path", "is required (the checkpoint name)")
        options = SaveOptions(request.path, request.ttl_seconds, request.overwrite, request.user_metadata or {})
        return await _submit_save(tenant, control, guard, request.model_id, request.seq_id, "training", options)


@router.post("/save_weights_for_sampler", response_model=UntypedAPIFuture)
@documents_body(SaveWeightsForSamplerRequest)
async def save_weights_for_sampler(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """Sampler weights: named (`path`) or an ephemeral snapshot (`sampling_session_seq_id`, answers a
    `sampling_session_id`); `inflight` is served as `snapshot`."""
    async with SeqIdGuard(control, tenant) as guard:
        request = parse_body(SaveWeightsForSamplerRequest, body)
        options = SaveOptions(request.path, request.ttl_seconds, user_metadata=request.user_metadata or {})
        return await _submit_save(tenant, control, guard, request.model_id, request.seq_id, "sampler", options,
                                  request.sampling_session_seq_id)


@router.post("/save_weights_external", response_model=UntypedAPIFuture)
@documents_body(SaveWeightsExternalRequest)
async def save_weights_external(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """A downloadable PEFT export under `external_weights/<path>` (files via `external_weights_urls`);
    with `age_encryption_recipients` every file is age-encrypted and served as `<file>.age`."""
    async with SeqIdGuard(control, tenant) as guard:
        request = parse_body(SaveWeightsExternalRequest, body)
        guard.track(request.model_id, request.seq_id)
        recipients = tuple(request.age_encryption_recipients or ())
        options = ExternalSaveOptions(request.path, request.ttl_seconds, age_recipients=recipients)
        return await _submit_save(tenant, control, guard, request.model_id, request.seq_id, "external", options)


@router.post("/load_weights", response_model=UntypedAPIFuture)
@documents_body(LoadWeightsRequest)
async def load_weights(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """Create-via-load (`session_id` + `model_seq_id`: the new model's seq 0) or the legacy in-place load
    (`model_id` + `seq_id`); result: `LoadWeightsResponse`."""
    async with SeqIdGuard(control, tenant) as guard:
        request = parse_body(LoadWeightsRequest, body)
        guard.track(request.model_id, request.seq_id)
        check_optimizer_config(request.optimizer_config)
        if request.creates_model:
            assert request.session_id is not None
            submitted = await control.load(
                tenant, path=request.path, with_optimizer=request.optimizer,
                session_id=SessionId(request.session_id), model_seq_id=request.model_seq_id,
            )
        else:
            assert request.model_id is not None
            submitted = await control.load(
                tenant, path=request.path, with_optimizer=request.optimizer,
                model_id=ModelId(request.model_id), seq_id=require_seq_id(request.seq_id),
            )
    return wire_json(UntypedAPIFuture(request_id=submitted.request_id, model_id=submitted.model_id))


# -- REST: training runs and checkpoints ----------------------------------------------------------


def cursor(page: Page) -> Cursor:
    return Cursor(offset=page.offset, limit=page.limit, total_count=page.total_count)


def checkpoint_wire(view: CheckpointView) -> Checkpoint:
    return Checkpoint(
        checkpoint_id=view.checkpoint_id, checkpoint_type=view.kind, time=view.created_at,
        tinker_path=view.tinker_path, size_bytes=view.size_bytes, public=view.public,
        user_metadata=view.user_metadata or None, expires_at=view.expires_at,
    )


def training_run_wire(view: TrainingRunView) -> TrainingRun:
    last = view.last_checkpoint
    last_sampler = view.last_sampler_checkpoint
    return TrainingRun(
        training_run_id=view.training_run_id, base_model=view.base_model, model_owner=view.model_owner,
        is_lora=True, corrupted=view.corrupted, lora_rank=view.lora.rank,
        last_request_time=view.last_request_time,
        last_checkpoint=checkpoint_wire(last) if last else None,
        last_sampler_checkpoint=checkpoint_wire(last_sampler) if last_sampler else None,
        user_metadata=view.user_metadata or None,
    )


@router.get("/training_runs", response_model=TrainingRunsResponse)
async def list_training_runs(
    tenant: CurrentTenant, control: Control, limit: Limit = DEFAULT_RUNS_LIMIT, offset: Offset = 0,
    access_scope: AccessScope = "owned", project_id: str | None = None,
) -> JSONResponse:
    """The caller's training runs, newest first (`accessible` lists the same: runs are never shared); with
    `project_id`, the runs of that project's sessions."""
    del access_scope
    runs, page = await control.list_training_runs(tenant, limit, offset, project_id)
    return wire_json(TrainingRunsResponse(training_runs=[training_run_wire(r) for r in runs], cursor=cursor(page)))


@router.get("/training_runs/{training_run_id}", response_model=TrainingRun)
async def get_training_run(
    training_run_id: str, tenant: CurrentTenant, control: Control, access_scope: AccessScope = "owned"
) -> JSONResponse:
    del access_scope
    return wire_json(training_run_wire(await control.get_training_run(tenant, ModelId(training_run_id))))


@router.get("/training_runs/{training_run_id}/checkpoints", response_model=CheckpointsListResponse)
async def list_run_checkpoints(
    training_run_id: str, tenant: CurrentTenant, control: Control, limit: Limit = MAX_PAGE, offset: Offset = 0
) -> JSONResponse:
    """One run's checkpoints, newest first."""
    views, page = await control.list_checkpoints(tenant, ModelId(training_run_id), limit, offset)
    return wire_json(CheckpointsListResponse(checkpoints=[checkpoint_wire(v) for v in views], cursor=cursor(page)))


@router.get("/checkpoints", response_model=CheckpointsListResponse)
async def list_user_checkpoints(
    tenant: CurrentTenant, control: Control, limit: Limit = DEFAULT_CHECKPOINTS_LIMIT, offset: Offset = 0
) -> JSONResponse:
    """All of the caller's checkpoints, newest first."""
    views, page = await control.list_checkpoints(tenant, None, limit, offset)
    return wire_json(CheckpointsListResponse(checkpoints=[checkpoint_wire(v) for v in views], cursor=cursor(page)))


def _tinker_path(training_run_id: str, checkpoint_id: str) -> str:
    return parse_checkpoint_id(training_run_id, checkpoint_id).uri


# The sub-resource routes come before the bare checkpoint route: `{checkpoint_id:path}` would swallow
# their suffix otherwise.
@router.post("/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/publish", status_code=204)
async def publish_checkpoint(
    training_run_id: str, checkpoint_id: str, tenant: CurrentTenant, control: Control
) -> Response:
    """Make a checkpoint readable (loadable, samplable) by every tenant."""
    await control.set_checkpoint_public(tenant, _tinker_path(training_run_id, checkpoint_id), True)
    return Response(status_code=204)


@router.delete("/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/publish", status_code=204)
async def unpublish_checkpoint(
    training_run_id: str, checkpoint_id: str, tenant: CurrentTenant, control: Control
) -> Response:
    """Make a published checkpoint private again."""
    if "/" not in checkpoint_id:
        # `DELETE .../checkpoints/weights/publish` deletes the checkpoint *named* "publish".
        return await delete_checkpoint(training_run_id, f"{checkpoint_id}/publish", tenant, control)
    await control.set_checkpoint_public(tenant, _tinker_path(training_run_id, checkpoint_id), False)
    return Response(status_code=204)


@router.put("/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/ttl", status_code=204)
@documents_body(SetCheckpointTtlRequest)
async def set_checkpoint_ttl(
    training_run_id: str, checkpoint_id: str, tenant: CurrentTenant, control: Control, body: RawBody
) -> Response:
    """Set (3600 s .. 10 years from now) or clear (`null`) a checkpoint's expiry."""
    request = parse_body(SetCheckpointTtlRequest, body)
    await control.set_checkpoint_ttl(tenant, _tinker_path(training_run_id, checkpoint_id), request.ttl_seconds)
    return Response(status_code=204)


@router.get(
    "/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls",
    response_model=ExternalWeightsUrlsResponse,
)
async def external_weights_urls(
    training_run_id: str, checkpoint_id: str, tenant: CurrentTenant, control: Control, base_url: PublicBaseUrl
) -> JSONResponse:
    """Signed, expiring download URLs for every file of a checkpoint (served by `GET download/{token}`)."""
    # The control plane's store appends the download route (`/api/v1/download/<token>`) itself.
    signed = await control.external_weights_urls(tenant, _tinker_path(training_run_id, checkpoint_id), base_url)
    return wire_json(ExternalWeightsUrlsResponse(urls=signed.urls, expires=signed.expires))


@router.delete("/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}", status_code=204)
async def delete_checkpoint(
    training_run_id: str, checkpoint_id: str, tenant: CurrentTenant, control: Control
) -> Response:
    """Delete one of the caller's checkpoints (its files included)."""
    await control.delete_checkpoint(tenant, _tinker_path(training_run_id, checkpoint_id))
    return Response(status_code=204)


@router.post("/weights_info", response_model=WeightsInfoResponse)
@documents_body(WeightsInfoRequest)
async def weights_info(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """Base model and LoRA shape of a checkpoint (the caller's or a published one)."""
    request = parse_body(WeightsInfoRequest, body)
    _, run = await control.get_checkpoint(tenant, request.tinker_path)
    lora = run.lora
    return wire_json(WeightsInfoResponse(
        base_model=run.base_model, is_lora=True, lora_rank=lora.rank, train_unembed=lora.train_unembed,
        train_mlp=lora.train_mlp, train_attn=lora.train_attn,
    ))


WEIGHTS_TOKEN_HEADER = "X-Tinker-Weights-Access-Token"


@router.post("/copy_weights", response_model=CopyWeightsResponse)
@documents_body(CopyWeightsRequest)
async def copy_weights(request: Request, tenant: CurrentTenant, control: Control, auth: Auth,
                       body: RawBody) -> JSONResponse:
    """Copy a checkpoint into a run of the caller's (`session_id` + `model_seq_id`) or a new session of
    `destination_project_id`. Own and published checkpoints need nothing more; another tenant's needs its
    owner's API key as `weights_access_token` (body or `X-Tinker-Weights-Access-Token`)."""
    copy = parse_body(CopyWeightsRequest, body)
    token = copy.weights_access_token or request.headers.get(WEIGHTS_TOKEN_HEADER)
    owner = None
    if token:
        owner = await auth.authenticate(token)
        if owner is None:
            raise ApiError(403, "weights_access_token is not a live API key of the checkpoint's owner",
                           field="weights_access_token")
    path = await control.copy_weights(
        tenant, copy.source_path, session_id=SessionId(copy.session_id) if copy.session_id else None,
        model_seq_id=copy.model_seq_id, project_id=copy.destination_project_id, ttl_seconds=copy.ttl_seconds,
        source_owner=owner,
    )
    return wire_json(CopyWeightsResponse(tinker_path=path))


@router.get("/download/{token:path}", response_class=FileResponse, tags=["download"])
async def download(token: str, control: Control) -> FileResponse:
    """One file of a checkpoint; the signed token is the credential (no API key)."""
    path = await control.open_signed_file(token)
    if not path.is_file():
        raise ApiError(404, "the signed file no longer exists", field="token")
    return FileResponse(path, filename=path.name, media_type="application/octet-stream")
