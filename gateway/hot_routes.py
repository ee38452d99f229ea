"""The per-call hot routes, served from the edge without FastAPI's routing and dependency machinery.

Why. Every training step of an SDK client is four HTTP requests (`forward_backward`, `optim_step` and a
`retrieve_future` long-poll for each), and most of a tenant's time in flight is spent in such a long-poll.
Through Starlette and FastAPI a request passes about twenty coroutine frames (middleware, the router's scan,
the included routers, `request_response`, the exception wrappers, the dependency solver) before it reaches
its endpoint, and a long-poll keeps all of them alive while it waits: at 512 tenants `bench/load.py` counted
16,000 live coroutines in the server, and the layers were most of the event loop's CPU per request.

What. `HotRoutes` sits inside `EdgeMiddleware` (request ids, body limits, per-caller limits and metrics
apply as before) and in front of the application. A request whose method and path are those of a hot route
has its endpoint's parameters resolved here and calls the same endpoint function FastAPI would call: the
route module stays the one definition of the route (its behaviour, its OpenAPI entry, its tests); only the
plumbing is skipped. Every other request goes through the application unchanged.

Which endpoints qualify is checked when the app is built (`hot_endpoints`): parameters may only be the
`Request` and dependencies that are coroutine functions taking only the `Request` and further such
dependencies (settings, control plane, authenticated tenant, raw body...), and the endpoint must return a
`Response`. Anything else (path, query, header or body parameters, a `def` or `yield` dependency) fails the
build, so a route changed later cannot be served wrongly by the short path. A dependency used twice in one
request runs once, as in FastAPI. Errors go to the application's own exception handlers; anything they do
not handle propagates to `EdgeMiddleware`'s last-resort 500, as before.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, get_type_hints

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.deps import api_routes

HOT_PATHS = (
    ("POST", "/api/v1/retrieve_future"),
    ("POST", "/api/v1/forward_backward"),
    ("POST", "/api/v1/optim_step"),
    ("POST", "/api/v1/asample"),
    ("POST", "/api/v1/retrieve_futures"),
    ("POST", "/api/v1/session_heartbeat"),
)
"""What an SDK client sends per step or per sample, and its heartbeat: the requests worth the short path."""


class NotHot(ValueError):
    """A route named hot whose endpoint needs FastAPI's full machinery."""


def hot_endpoints(app: FastAPI, paths: Iterable[tuple[str, str]] = HOT_PATHS) -> dict[tuple[str, str], APIRoute]:
    """The app's hot routes by (method, path), each checked to be servable here; raises `NotHot` if not."""
    routes = {(method, route.path): route for route in api_routes(app.routes) for method in route.methods}
    endpoints: dict[tuple[str, str], APIRoute] = {}
    for key in paths:
        route = routes.get(key)
        if route is None:
            raise NotHot(f"no route {key[0]} {key[1]} to serve as a hot route")
        _check(route.dependant, f"{key[0]} {key[1]}", top=True)
        _check_returns_a_response(route.endpoint, f"{key[0]} {key[1]}")
        endpoints[key] = route
    return endpoints


def _check(dependant: Dependant, where: str, *, top: bool = False) -> None:
    extra = (dependant.path_params or dependant.query_params or dependant.header_params or dependant.cookie_params
             or dependant.body_params or dependant.websocket_param_name or dependant.http_connection_param_name
             or dependant.response_param_name or dependant.background_tasks_param_name
             or dependant.security_scopes_param_name)
    if extra:
        raise NotHot(f"{where}: {dependant.call!r} takes parameters other than the request and dependencies")
    if not inspect.iscoroutinefunction(dependant.call):
        kind = "endpoint" if top else "dependency"
        raise NotHot(f"{where}: the {kind} {dependant.call!r} is not a coroutine function")
    for sub in dependant.dependencies:
        _check(sub, where)


def _check_returns_a_response(endpoint: Callable[..., Any], where: str) -> None:
    """The short path sends what the endpoint returns as is: it must be a `Response`, never data for FastAPI
    to serialise through a `response_model`."""
    returned = get_type_hints(endpoint).get("return")
    if not (isinstance(returned, type) and issubclass(returned, Response)):
        raise NotHot(f"{where}: {endpoint!r} is not declared to return a Response (got {returned!r})")


class HotRoutes:
    """ASGI middleware: serves `endpoints` itself, passes everything else to `app`."""

    def __init__(self, app: ASGIApp, *, endpoints: Mapping[tuple[str, str], APIRoute]) -> None:
        self.app = app
        self.endpoints = dict(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        http = scope["type"] == "http"
        route = self.endpoints.get((scope["method"], scope["path"])) if http else None
        if route is None or scope["app"].dependency_overrides:  # overrides (tests, tools): FastAPI applies them
            await self.app(scope, receive, send)
            return
        scope["route"] = route  # the metrics label reads `scope["route"].path`
        request = Request(scope, receive)
        try:
            response = await _solve(route.dependant, request, {})
        except Exception as exc:
            response = await _handled(request, exc)
        await response(scope, receive, send)


async def _solve(dependant: Dependant, request: Request, cache: dict[Callable[..., Any], Any]) -> Any:
    """Call `dependant` with the request and its dependencies' values (each dependency once per request)."""
    kwargs: dict[str, Any] = {}
    if dependant.request_param_name:
        kwargs[dependant.request_param_name] = request
    for sub in dependant.dependencies:
        assert sub.call is not None and sub.name is not None
        if sub.use_cache and sub.call in cache:
            kwargs[sub.name] = cache[sub.call]
            continue
        kwargs[sub.name] = cache[sub.call] = await _solve(sub, request, cache)
    assert dependant.call is not None
    call: Callable[..., Awaitable[Any]] = dependant.call
    return await call(**kwargs)


async def _handled(request: Request, exc: Exception) -> Response:
    """The application's handler's answer to `exc` (by the exception's class hierarchy), else `exc` again."""
    handlers: Mapping[Any, Callable[[Request, Exception], Awaitable[Response]]] = request.app.exception_handlers
    for cls in type(exc).__mro__:
        handler = handlers.get(cls)
        if handler is not None:
            return await handler(request, exc)
    raise exc

