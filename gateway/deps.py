"""FastAPI dependencies and their `Annotated` aliases: settings, control plane, caller, raw body.

Routes declare what they need by type, e.g. `tenant: CurrentTenant, control: Control, body: RawBody`.
Everything comes from `request.app.state` (set by `create_app`), so there is no module-level state and
several apps can live in one process (tests do this).

JSON bodies are read raw and validated with `services.wire.parse_request` rather than as FastAPI body
parameters: one validation path for every client, `WireError`s that carry `model_id` / `seq_id` so a
rejected training submission can still consume its seq_id, and the body-size limit applied first.
Because FastAPI cannot see those bodies, a route marks its endpoint with `@documents_body(Model)` (or
`(content_type, Model | None)` pairs, None = opaque binary such as protobuf) and `install_openapi` adds
the matching `requestBody` to the OpenAPI schema, nested models under `components.schemas`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.routing import BaseRoute

from gateway.auth import API_KEY_HEADER, JWT_PREFIX, Authenticator, CredentialError, credential_from_headers
from gateway.rendering import SampleRenderCache
from gateway.settings import GatewaySettings
from services.auth.tenants import Tenant
from services.control.api import ControlPlane
from services.wire import parse_request

ModelT = TypeVar("ModelT", bound=BaseModel)

# The OpenAPI "Authorize" dialog's schemes, declared on every route that needs `current_tenant` by
# `install_openapi` (as FastAPI security dependencies they would also run on every request).
SECURITY_SCHEMES: dict[str, dict[str, str]] = {
    "APIKeyHeader": {"type": "apiKey", "description": "API key `tml-...`", "in": "header", "name": API_KEY_HEADER},
    "HTTPBearer": {"type": "http", "description": "API key `tml-...` as a bearer token", "scheme": "bearer"},
}


# These read `app.state` only, so they are coroutines: FastAPI runs a plain `def` dependency in its thread
# pool, a hop (and, under load, a wait for a free thread) on every request.
async def app_settings(request: Request) -> GatewaySettings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def control_plane(request: Request) -> ControlPlane:
    return request.app.state.control  # type: ignore[no-any-return]


async def authenticator(request: Request) -> Authenticator:
    return request.app.state.auth  # type: ignore[no-any-return]


async def sample_render_cache(request: Request) -> SampleRenderCache:
    return request.app.state.sample_render  # type: ignore[no-any-return]


SettingsDep = Annotated[GatewaySettings, Depends(app_settings)]
Control = Annotated[ControlPlane, Depends(control_plane)]
Auth = Annotated[Authenticator, Depends(authenticator)]
RenderCache = Annotated[SampleRenderCache, Depends(sample_render_cache)]


async def current_tenant(
    request: Request,
    auth: Auth,
) -> Tenant:
    """The authenticated caller; 401 (JSON, naming the header) for a missing, unknown or revoked key."""
    metrics = request.app.state.metrics
    try:
        key = credential_from_headers(request.headers)
    except CredentialError:
        present = API_KEY_HEADER in request.headers or "authorization" in request.headers
        metrics.auth_failed("malformed" if present else "missing")
        raise
    if key.startswith(JWT_PREFIX):
        # A JWT from `auth/token`: signature, expiry, and its API key still live (services/control/jwt_tokens.py).
        request.state.credential_kind = "jwt"
        tenant = await request.app.state.control.authenticate_token(key)
        if tenant is None:
            metrics.auth_failed("rejected")
            raise CredentialError("invalid JWT: expired, or its API key was revoked", invalid_token=True)
    else:
        tenant = await auth.authenticate(key)
    if tenant is None:
        metrics.auth_failed("rejected")
        raise CredentialError("invalid API key: unknown, revoked, or its tenant is disabled")
    request.state.tenant_id = tenant.id
    return tenant


CurrentTenant = Annotated[Tenant, Depends(current_tenant)]


async def request_body(request: Request) -> bytes:
    """The raw body (the edge middleware has already capped its size)."""
    return await request.body()


RawBody = Annotated[bytes, Depends(request_body)]


async def public_base_url(request: Request, settings: SettingsDep) -> str:
    """Externally visible base URL without a trailing `/` (settings first, else the request's own)."""
    if settings.public_base_url:
        return settings.public_base_url.rstrip("/")
    return str(request.base_url).rstrip("/")


PublicBaseUrl = Annotated[str, Depends(public_base_url)]


def parse_body(model: type[ModelT], body: bytes) -> ModelT:
    """Validate a JSON body into a wire model; an empty body counts as `{}` (all-default bodies)."""
    return parse_request(model, body if body.strip() else b"{}")


# -- OpenAPI for hand-parsed bodies ------------------------------------------------------------
F = TypeVar("F", bound=Callable[..., Any])
BodySpec = tuple[str, type[BaseModel] | None]
_BODY_ATTR = "__carpool_request_body__"
JSON = "application/json"
REF_TEMPLATE = "#/components/schemas/{model}"


def documents_body(*specs: type[BaseModel] | BodySpec) -> Callable[[F], F]:
    """Mark an endpoint as taking these bodies (a bare model means `application/json`)."""
    normalized: list[BodySpec] = [(JSON, s) if isinstance(s, type) else s for s in specs]

    def mark(endpoint: F) -> F:
        setattr(endpoint, _BODY_ATTR, tuple(normalized))
        return endpoint

    return mark


def install_openapi(app: FastAPI) -> None:
    """Replace `app.openapi` with a generator that also documents hand-parsed bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _build(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components: dict[str, Any] = schema.setdefault("components", {}).setdefault("schemas", {})
    schema["components"]["securitySchemes"] = SECURITY_SCHEMES
    for route in api_routes(app.routes):
        specs: tuple[BodySpec, ...] | None = getattr(route.endpoint, _BODY_ATTR, None)
        content = {ctype: {"schema": _schema_ref(model, components)} for ctype, model in specs or ()}
        authenticated = _depends_on(route.dependant, current_tenant)
        for method in route.methods:
            operation = schema["paths"].get(route.path_format, {}).get(method.lower())
            if operation is None:
                continue
            if content:
                operation["requestBody"] = {"required": True, "content": content}
            if authenticated:
                operation["security"] = [{name: []} for name in SECURITY_SCHEMES]
    return schema


def _depends_on(dependant: Dependant, call: Callable[..., Any]) -> bool:
    return any(d.call is call or _depends_on(d, call) for d in dependant.dependencies)


def api_routes(routes: Iterable[BaseRoute]) -> Iterator[APIRoute]:
    """Every `APIRoute`, also inside included routers (recent FastAPI keeps them nested)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        nested = getattr(route, "original_router", None)
        if nested is not None:
            yield from api_routes(nested.routes)


def _schema_ref(model: type[BaseModel] | None, components: dict[str, Any]) -> dict[str, Any]:
    if model is None:
        return {"type": "string", "format": "binary"}
    if model.__name__ not in components:
        js = model.model_json_schema(ref_template=REF_TEMPLATE)
        components.update(js.pop("$defs", {}))
        components[model.__name__] = js
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}
