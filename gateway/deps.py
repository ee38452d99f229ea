"""FastAPI dependencies and their `Annotated` aliases: settings, control plane, caller, raw body.

Routes declare what they need by type, e.g. `tenant: CurrentTenant, control: Control, body: RawBody`.
Everything comes from `request.app.state` (set by `create_app`), so there is no module-level state and
several apps can live in one process (tests do this).

JSON bodies are read raw and validated with `services.wire.parse_request` rather than as FastAPI body
parameters: one validation path for every client, `WireError`s that carry `model_id` / `seq_id` so a
rejected training submission can still consume its seq_id, and the body-size limit applied first.
The OpenAPI schema still documents each body (see `gateway.openapi`).
"""

from __future__ import annotations

from typing import Annotated, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from gateway.auth import API_KEY_HEADER, Authenticator, CredentialError, credential_from_headers
from gateway.rendering import SampleRenderCache
from gateway.settings import GatewaySettings
from services.auth.tenants import Tenant
from services.control.api import ControlPlane
from services.wire import parse_request

ModelT = TypeVar("ModelT", bound=BaseModel)

# Declared for the OpenAPI "Authorize" dialog only; `current_tenant` reads the headers itself.
_api_key_scheme = APIKeyHeader(name=API_KEY_HEADER, auto_error=False, description="API key `tml-...`")
_bearer_scheme = HTTPBearer(auto_error=False, description="API key `tml-...` as a bearer token")


def app_settings(request: Request) -> GatewaySettings:
    return request.app.state.settings  # type: ignore[no-any-return]


def control_plane(request: Request) -> ControlPlane:
    return request.app.state.control  # type: ignore[no-any-return]


def authenticator(request: Request) -> Authenticator:
    return request.app.state.auth  # type: ignore[no-any-return]


def sample_render_cache(request: Request) -> SampleRenderCache:
    return request.app.state.sample_render  # type: ignore[no-any-return]


SettingsDep = Annotated[GatewaySettings, Depends(app_settings)]
Control = Annotated[ControlPlane, Depends(control_plane)]
Auth = Annotated[Authenticator, Depends(authenticator)]
RenderCache = Annotated[SampleRenderCache, Depends(sample_render_cache)]


async def current_tenant(
    request: Request,
    auth: Auth,
    _api_key: Annotated[str | None, Depends(_api_key_scheme)],
    _bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer_scheme)],
) -> Tenant:
    """The authenticated caller; 401 (JSON, naming the header) for a missing, unknown or revoked key."""
    key = credential_from_headers(request.headers)
    tenant = await auth.authenticate(key)
    if tenant is None:
        raise CredentialError("invalid API key: unknown, revoked, or its tenant is disabled")
    request.state.tenant_id = tenant.id
    return tenant


CurrentTenant = Annotated[Tenant, Depends(current_tenant)]


async def request_body(request: Request) -> bytes:
    """The raw body (the edge middleware has already capped its size)."""
    return await request.body()


RawBody = Annotated[bytes, Depends(request_body)]


def public_base_url(request: Request, settings: SettingsDep) -> str:
    """Externally visible base URL without a trailing `/` (settings first, else the request's own)."""
    if settings.public_base_url:
        return settings.public_base_url.rstrip("/")
    return str(request.base_url).rstrip("/")


PublicBaseUrl = Annotated[str, Depends(public_base_url)]


def parse_body(model: type[ModelT], body: bytes) -> ModelT:
    """Validate a JSON body into a wire model; an empty body counts as `{}` (all-default bodies)."""
    return parse_request(model, body if body.strip() else b"{}")
