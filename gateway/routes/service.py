"""Client plumbing of the Tinker API: client config, sessions (create, heartbeat, finish, and the
`RestClient` listing), telemetry, capabilities, health, and the key endpoints of the `tinker auth` CLI.

`client/config` is the first request of every SDK client (a 404 there breaks client construction); it
advertises exactly what is served: the batched sampling poller, joined sampling clients and server-side
custom losses are on; JWT mode (`pjwt_auth_enabled`) follows `CARPOOL_JWT_AUTH_ENABLED`, while `auth/token`
itself always works. Everything but `healthz` needs a credential (an API key, or a JWT from `auth/token`).
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from gateway.auth import CredentialError
from gateway.deps import Auth, Control, CurrentTenant, RawBody, SettingsDep, documents_body, parse_body
from gateway.rendering import wire_json
from gateway.settings import GatewaySettings
from services.db.ids import SessionId
from services.wire.control import (
    ClientConfigRequest,
    CreateSessionRequest,
    SessionFinishRequest,
    SessionHeartbeatRequest,
    TelemetrySendRequest,
)
from services.wire.responses import (
    AuthTokenResponse,
    ClientConfigResponse,
    ClientDynamicConfigResponse,
    CreateSessionResponse,
    SessionHeartbeatResponse,
    TelemetryResponse,
)
from services.wire.rest import (
    AccessScope,
    GetServerCapabilitiesResponse,
    GetSessionResponse,
    HealthResponse,
    ListSessionsResponse,
    SupportedModel,
)

log = logging.getLogger(__name__)
router = APIRouter(prefix="/api/v1", tags=["service"])


def client_config_response(settings: GatewaySettings) -> ClientConfigResponse:
    """The feature flags every SDK client fetches first."""
    return ClientConfigResponse(
        use_pyqwest_transport=settings.use_pyqwest_transport,
        proto_compress_fwdbwd=settings.proto_compress_fwdbwd,
        parallel_fwdbwd_chunks=settings.parallel_fwdbwd_chunks,
        fwdbwd_max_chunk_len=settings.fwdbwd_max_chunk_len,
        fwdbwd_max_chunk_bytes_count=settings.fwdbwd_max_chunk_bytes_count,
        sample_max_concurrent_requests=settings.sample_max_concurrent_requests,
        # Served (gateway/routes/futures.py, sampling.py, custom_losses.py): the SDK uses them when told so.
        sample_use_retrieve_futures=settings.sample_batch_poller,
        sample_join_sampling_session=True,
        custom_loss_server_side=True,
        pjwt_auth_enabled=settings.jwt_auth_enabled,
    )


@router.post("/client/config", response_model=ClientConfigResponse)
@documents_body(ClientConfigRequest)
async def client_config(_: CurrentTenant, settings: SettingsDep, body: RawBody) -> JSONResponse:
    parse_body(ClientConfigRequest, body)
    return wire_json(client_config_response(settings))


@router.post("/client/dynamic_config", response_model=ClientDynamicConfigResponse)
@documents_body(ClientConfigRequest)
async def client_dynamic_config(_: CurrentTenant, settings: SettingsDep, body: RawBody) -> JSONResponse:
    parse_body(ClientConfigRequest, body)
    return wire_json(
        ClientDynamicConfigResponse(
            refresh_interval_sec=settings.dynamic_config_refresh_seconds,
            sample_cancel_enabled=settings.sample_cancel_enabled,
        )
    )


@router.post("/create_session", response_model=CreateSessionResponse)
@documents_body(CreateSessionRequest)
async def create_session(
    tenant: CurrentTenant, control: Control, settings: SettingsDep, body: RawBody
) -> JSONResponse:
    """Start a client session (the SDK's first stateful call)."""
    request = parse_body(CreateSessionRequest, body)
    session_id = await control.create_session(
        tenant, tags=list(request.tags), user_metadata=dict(request.user_metadata or {}),
        sdk_version=request.sdk_version, project_id=request.project_id,
    )
    warning = None
    if settings.sdk_version_is_old(request.sdk_version):
        warning = (
            f"tinker SDK {request.sdk_version} is older than {settings.min_sdk_version}, the version this "
            f"server is tested with; upgrade with `pip install -U 'tinker>={settings.min_sdk_version}'`"
        )
    return wire_json(CreateSessionResponse(session_id=session_id, warning_message=warning))


@router.post("/session_heartbeat", response_model=SessionHeartbeatResponse)
@documents_body(SessionHeartbeatRequest)
async def session_heartbeat(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    request = parse_body(SessionHeartbeatRequest, body)
    await control.heartbeat(tenant, SessionId(request.session_id))
    return wire_json(SessionHeartbeatResponse())


class SessionFinished(BaseModel):
    """Answer of `sessions/{session_id}/finish` (the SDK ignores it)."""

    session_id: str
    finished: bool = True


@router.post("/sessions/{session_id}/finish", response_model=SessionFinished)
@documents_body(SessionFinishRequest)
async def finish_session(
    session_id: str, tenant: CurrentTenant, control: Control, body: RawBody
) -> JSONResponse:
    """Close a session (`ServiceClient.close()` / leaving its `with` block)."""
    if body.strip():
        parse_body(SessionFinishRequest, body)
    await control.finish_session(tenant, SessionId(session_id))
    return wire_json(SessionFinished(session_id=session_id))


@router.post("/telemetry", response_model=TelemetryResponse)
@documents_body(TelemetrySendRequest)
async def telemetry(tenant: CurrentTenant, body: RawBody) -> JSONResponse:
    """Accept SDK telemetry; client-side exceptions are logged (they explain many client failures)."""
    batch = parse_body(TelemetrySendRequest, body)
    logged = 0
    for event in batch.events:
        if logged < TELEMETRY_LOGGED_PER_BATCH and (
                event.event == "UNHANDLED_EXCEPTION" or (event.event_name or "").endswith("validation_error")):
            logged += 1  # client strings are capped: a tenant must not be able to flood the server's logs
            log.info("client telemetry from tenant %s session %s: %s %s %s", tenant.id, _clip(batch.session_id),
                     _clip(event.event_name or event.event), _clip(event.error_type or ""),
                     _clip(event.error_message or ""))
    return wire_json(TelemetryResponse())


TELEMETRY_LOGGED_PER_BATCH = 10
"""Most telemetry events of one batch that are logged."""
TELEMETRY_LOGGED_CHARS = 256
"""Longest client string logged from telemetry (longer ones are cut)."""


def _clip(text: str) -> str:
    return text if len(text) <= TELEMETRY_LOGGED_CHARS else text[:TELEMETRY_LOGGED_CHARS] + "…"


@router.get("/get_server_capabilities", response_model=GetServerCapabilitiesResponse)
async def get_server_capabilities(_: CurrentTenant, control: Control) -> JSONResponse:
    """The base models tenants can train and sample."""
    models = [
        SupportedModel(model_name=m.name, max_context_length=m.max_context, trainable=True, sampleable=True)
        for m in control.base_models()
    ]
    return wire_json(GetServerCapabilitiesResponse(supported_models=models))


@router.get("/healthz", response_model=HealthResponse)
async def healthz() -> JSONResponse:
    """Liveness (no API key needed)."""
    return wire_json(HealthResponse())


class ApiKeyOrgDetails(BaseModel):
    name: str


class ApiKeyUserDetails(BaseModel):
    email: str


class ApiKeyDetails(BaseModel):
    org_details: ApiKeyOrgDetails
    user_details: ApiKeyUserDetails


class SelfApiKeyResponse(BaseModel):
    """What `tinker auth login` validates (`tinker.cli.auth_api.SelfApiKeyResponse`)."""

    key_id: int
    name: str
    note: str
    details: ApiKeyDetails


@router.get("/auth/apikey/me", response_model=SelfApiKeyResponse, tags=["auth"])
async def get_own_api_key(tenant: CurrentTenant) -> JSONResponse:
    """Public metadata of the presented key (used by `tinker auth login`)."""
    answer = SelfApiKeyResponse(
        key_id=tenant.api_key_id or 0,
        name=f"{tenant.name} key",
        note="Carpool API key",
        details=ApiKeyDetails(
            org_details=ApiKeyOrgDetails(name=tenant.name),
            user_details=ApiKeyUserDetails(email=tenant.name),
        ),
    )
    return JSONResponse(answer.model_dump(mode="json"))


class RevokedKey(BaseModel):
    """Answer of `DELETE auth/apikey/me`."""

    revoked: bool


@router.delete("/auth/apikey/me", response_model=RevokedKey, tags=["auth"])
async def revoke_own_api_key(tenant: CurrentTenant, auth: Auth) -> JSONResponse:
    """Revoke the presented key itself (used by `tinker auth logout`); other keys are untouched."""
    return JSONResponse(RevokedKey(revoked=await auth.revoke(tenant)).model_dump())


@router.post("/auth/token", tags=["auth"], response_model=AuthTokenResponse)
async def auth_token(request: Request, tenant: CurrentTenant, control: Control) -> JSONResponse:
    """Exchange the presented API key for a short-lived JWT (the SDK's JWT mode). The JWT works like the key
    until it expires or the key is revoked; a JWT cannot mint another one (401), so a leaked JWT dies."""
    if getattr(request.state, "credential_kind", "api_key") != "api_key" or tenant.api_key_id is None:
        raise CredentialError("auth/token exchanges an API key; a JWT cannot be exchanged for another")
    token, _ttl = control.mint_auth_token(tenant)
    return wire_json(AuthTokenResponse(jwt=token))


# -- sessions (RestClient; projects, search and traces: gateway/routes/projects.py) -------------
DEFAULT_SESSIONS_LIMIT = 20


@router.get("/sessions", tags=["sessions"], response_model=ListSessionsResponse)
async def list_sessions(
    tenant: CurrentTenant, control: Control,
    limit: Annotated[int, Query(ge=1, le=1000)] = DEFAULT_SESSIONS_LIMIT,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
    access_scope: AccessScope = "owned",
) -> JSONResponse:
    """The caller's session ids, newest first."""
    del access_scope
    session_ids, _ = await control.list_sessions(tenant, limit, offset)
    return wire_json(ListSessionsResponse(sessions=list(session_ids)))


@router.get("/sessions/{session_id}", tags=["sessions"], response_model=GetSessionResponse)
async def get_session(
    session_id: str, tenant: CurrentTenant, control: Control, access_scope: AccessScope = "owned"
) -> JSONResponse:
    """A session's training runs and sampling sessions."""
    del access_scope
    view = await control.get_session(tenant, SessionId(session_id))
    return wire_json(GetSessionResponse(
        training_run_ids=list(view.training_run_ids), sampler_ids=list(view.sampler_ids),
        user_metadata=view.user_metadata or None,
    ))
