"""The gateway's composition: `create_app(settings, control, auth)` builds one FastAPI application.

The factory is the only place that wires settings, the control plane, the authenticator, routes,
error handlers, middleware, OpenAPI and log redaction together. It creates no global state: every
dependency lives in `app.state` (`settings`, `control`, `auth`, `metrics`, `sample_render`), so tests
and embedded deployments can build as many apps as they like.

    app = create_app(GatewaySettings(), control_plane, DatabaseAuthenticator(database))
    uvicorn.run(app, host="0.0.0.0", port=8000)
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from gateway.admin import AdminConsole, install_admin, make_templates
from gateway.auth import Authenticator
from gateway.blocking_pool import FairBlockingPool
from gateway.deps import install_openapi
from gateway.edge_limits import DecodePool, EdgeLimiter, EdgeLimitOptions
from gateway.errors import install_error_handlers
from gateway.hot_routes import HotRoutes, hot_endpoints
from gateway.middleware import EdgeMiddleware
from gateway.rendering import SampleRenderCache
from gateway.routes import admin, custom_losses, futures, hub, projects, rest, sampling, service, training, weights
from gateway.settings import GatewaySettings
from services.auth.log_redaction import RedactApiKeysFilter
from services.control.api import ControlPlane
from services.db.database import Database
from services.hub.service import HubPushService
from services.metrics import (
    CONTENT_TYPE,
    GatewayMetrics,
    GroupCommitCollector,
    ProcessMetrics,
    RuntimeStatsCollector,
    render,
)

API_VERSION = "0.1.0"
REDACTED_LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "gateway", "fastapi")
"""Loggers (root = "") whose records and handlers get the API-key redaction filter."""

DESCRIPTION = """Multi-tenant LoRA training behind the Tinker API.

* **Tinker SDK** (`tinker>=0.38`, unmodified): point `base_url` at this server, use an API key `tml-...`.
* **REST** (`/v1/...`): the same operations as JSON; authenticate with `X-API-Key: tml-...` or
  `Authorization: Bearer tml-...`. Futures: `GET /v1/futures/{request_id}?wait=<seconds>`.

Errors are JSON: `{"detail": ..., "field": ...}`.
"""


def create_app(settings: GatewaySettings, control: ControlPlane, auth: Authenticator, *,
               metrics: ProcessMetrics | None = None, hub_pushes: HubPushService | None = None,
               admin_database: Database | None = None, pass_token_budget: int | None = None) -> FastAPI:
    """A ready gateway application over `control`, authenticating callers with `auth`.

    `metrics`: the process's Prometheus registry when the caller shares it with other components (the
    embedded scheduler loops); by default the app gets a registry of its own. `admin_database`: serve the
    operators' dashboard at `/admin` over it (unless `settings.admin_enabled` is off); `pass_token_budget`
    is what its scheduler page measures passes against.
    """
    app = FastAPI(
        title="Carpool",
        version=API_VERSION,
        description=DESCRIPTION,
        docs_url="/docs" if settings.docs_enabled else None,
        openapi_url="/openapi.json" if settings.docs_enabled else None,
        redoc_url=None,
        lifespan=_lifespan,
        **fastapi_telemetry(settings),
    )
    app.state.settings = settings
    app.state.control = control
    app.state.auth = auth
    app.state.hub = hub_pushes  # `/v1/hub_pushes` answers 503 without it
    process_metrics = metrics or ProcessMetrics.create()
    app.state.process_metrics = process_metrics
    app.state.metrics = GatewayMetrics(process_metrics.registry)
    app.state.sample_render = SampleRenderCache(settings.sample_render_cache_size)
    app.state.decode_pool = DecodePool(settings.decode_threads)
    install_error_handlers(app)
    # Routers are matched in order, each scanning its routes, and no two share a path: the per-call hot
    # routes (retrieve_future, then forward_backward / optim_step) go first.
    for module in (futures, training, service, weights, sampling, custom_losses, projects, admin):
        app.include_router(module.router)
    app.include_router(rest.router)
    app.include_router(hub.router)
    if settings.metrics_enabled:
        _add_metrics_route(app, process_metrics, control)
    if settings.hot_routes:  # added before EdgeMiddleware, so it runs inside it
        app.add_middleware(HotRoutes, endpoints=hot_endpoints(app))
    app.add_middleware(EdgeMiddleware, metrics=app.state.metrics, max_body_bytes=settings.max_body_bytes,
                       limiter=EdgeLimiter(edge_limit_options(settings)))
    if admin_database is not None and settings.admin_enabled:
        _add_admin(app, settings, admin_database, process_metrics, pass_token_budget)
    install_openapi(app)
    install_key_redaction()
    return app


def _add_admin(app: FastAPI, settings: GatewaySettings, database: Database, metrics: ProcessMetrics,
               pass_token_budget: int | None) -> None:
    runtime_stats = getattr(app.state.control, "runtime_stats", None)
    quota_standing = getattr(app.state.control, "quota_standing", None)  # optional, like runtime_stats
    install_admin(app, AdminConsole(
        database=database, auth=app.state.auth, metrics=metrics,
        runtime_stats=runtime_stats if callable(runtime_stats) else list,
        session_ttl=timedelta(minutes=settings.admin_session_minutes), page_size=settings.admin_page_size,
        templates=make_templates(), pass_token_budget=pass_token_budget,
        quota_standing=quota_standing if callable(quota_standing) else None, hub_pushes=app.state.hub))


def _add_metrics_route(app: FastAPI, metrics: ProcessMetrics, control: ControlPlane) -> None:
    runtime_stats = getattr(control, "runtime_stats", None)  # optional `RuntimeIntrospection`
    if callable(runtime_stats):
        metrics.registry.register(RuntimeStatsCollector(runtime_stats))
    group_commit_stats = getattr(control, "group_commit_stats", None)  # optional, like runtime_stats
    if callable(group_commit_stats):
        metrics.registry.register(GroupCommitCollector(group_commit_stats))

    async def metrics_text() -> Response:
        """This process's series (gateway, and in embedded mode the scheduler loops' and engines') plus the
        active schedulers' counters, in the Prometheus text format."""
        return Response(render(metrics.registry), media_type=CONTENT_TYPE)

    app.add_api_route("/metrics", metrics_text, methods=["GET"], tags=["ops"], include_in_schema=False)


def fastapi_telemetry(settings: GatewaySettings) -> dict[str, Any]:
    """FastAPI's `telemetry` argument: everything off unless `settings.otel_telemetry` (no argument at all for a
    FastAPI without native telemetry). Why off: with it on, every request asks OpenTelemetry for the global
    tracer, meter and logger providers before it is served (`NativeTelemetry.enabled`), 3-4 % of the event
    loop's CPU on the SDK's per-step requests (cProfile, session 18), for spans nobody collects unless a
    provider was set up."""
    if settings.otel_telemetry or "telemetry" not in inspect.signature(FastAPI).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}


def edge_limit_options(settings: GatewaySettings) -> EdgeLimitOptions:
    """The per-caller edge limits of `settings` (see `gateway.edge_limits`)."""
    return EdgeLimitOptions(
        max_in_flight=settings.edge_max_in_flight, rate_per_s=settings.edge_rate_per_second,
        burst=settings.edge_rate_burst, failed_auth_per_minute=settings.edge_failed_auth_per_minute,
        failed_auth_burst=settings.edge_failed_auth_burst, max_small_body_bytes=settings.max_small_body_bytes,
    )


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    # uvicorn (re)configures its handlers after the app is built: redact again once the server runs.
    install_key_redaction()
    # Blocking control-plane work (`asyncio.to_thread`) runs on a bounded pool shared fairly by callers;
    # the event loop shuts it down with itself (work after the lifespan, such as teardown, still runs).
    asyncio.get_running_loop().set_default_executor(FairBlockingPool(app.state.settings.blocking_threads))
    yield
    app.state.decode_pool.shutdown()


def install_key_redaction() -> None:
    """Put `RedactApiKeysFilter` on the gateway's and uvicorn's loggers and their handlers (idempotent).

    Logger filters only see records logged on that very logger, handler filters see propagated ones
    too; both are set so keys are redacted whichever way a record travels.
    """
    for name in REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        for target in (logger, *logger.handlers):
            if not any(isinstance(f, RedactApiKeysFilter) for f in target.filters):
                target.addFilter(RedactApiKeysFilter())
