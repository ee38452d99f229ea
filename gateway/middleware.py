"""The ASGI middleware at the edge of every request: request id, body-size limit, metrics, last-resort 500.

A plain ASGI class (not `BaseHTTPMiddleware`, which buffers and interferes with long-polls). It
- tags the request with an id (a sane incoming `X-Request-Id`, else a fresh one), echoed on the answer
  and available as `request.state.request_id`;
- answers 413 before reading a body whose `Content-Length` is over the limit of its route (bulk-data
  routes `max_body_bytes`, the others a small cap), and makes `receive` raise `BodyTooLarge` when a
  streamed body crosses it (the route's handler turns that into a 413);
- applies the per-caller in-flight, rate and failed-authentication limits of `EdgeLimiter` (429 with
  `Retry-After`) before the app runs;
- records per-route counts and latency in the process's `GatewayMetrics` (prometheus-client series);
- turns an unexpected exception into a JSON 500 that says nothing about internals (the traceback is
  logged with the request id; headers are never logged).

The series live in `services.metrics.series` and are served from the app's registry at `/metrics`.
Routes are labelled by their template (`/api/v1/samplers/{sampler_id:path}`), never the raw path, so ids
cannot blow up the label set; unmatched paths share one label.
"""

from __future__ import annotations

import itertools
import logging
import re
import secrets
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.blocking_pool import CURRENT_CALLER
from gateway.edge_limits import EdgeLimiter, caller_of
from gateway.errors import BodyTooLarge, body_too_large_response, error_response, retry_after_headers
from services.metrics.series import UNMATCHED_ROUTE, GatewayMetrics

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class EdgeMiddleware:
    """See the module docstring."""

    def __init__(self, app: ASGIApp, *, metrics: GatewayMetrics, max_body_bytes: int,
                 limiter: EdgeLimiter | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.limiter = limiter or EdgeLimiter()
        self.request_ids = RequestIds()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope, self.request_ids)
        scope.setdefault("state", {})["request_id"] = request_id
        status = {"code": 500, "started": False}
        send_tagged = _tagging_send(send, request_id, status)
        started_at = time.perf_counter()
        self.metrics.started()
        try:
            await self._handle(scope, receive, send_tagged, status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or UNMATCHED_ROUTE
            self.metrics.finished(scope["method"], template, int(status["code"]),
                                  time.perf_counter() - started_at)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, status: dict[str, Any]) -> None:
        caller = caller_of(scope)
        refusal = self.limiter.admit(caller)
        if refusal is not None:
            response = error_response(429, refusal.detail, headers=retry_after_headers(refusal.retry_after_s))
            await response(scope, receive, send)
            return
        token = CURRENT_CALLER.set(caller.key)  # the blocking pool serves callers round robin
        try:
            await self._limited(scope, receive, send, status)
        finally:
            CURRENT_CALLER.reset(token)
            self.limiter.release(caller, int(status["code"]))

    async def _limited(self, scope: Scope, receive: Receive, send: Send, status: dict[str, Any]) -> None:
        limit = self.limiter.body_limit(scope["path"], self.max_body_bytes)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await body_too_large_response(limit)(scope, receive, send)
            return
        try:
            await self.app(scope, _limited_receive(receive, limit), send)
        except Exception:
            log.exception("unhandled error in %s %s (request id %s)", scope["method"], scope["path"],
                          scope["state"]["request_id"])
            if status["started"]:
                raise
            response = error_response(500, "internal server error", request_id=scope["state"]["request_id"])
            await response(scope, receive, send)


class RequestIds:
    """Mints request ids: 32 hex characters, a random prefix per middleware and a counter.

    Not `uuid4()` per request: it reads the system's random source, a system call that releases the GIL,
    and under load the event loop then waits to get it back behind the scheduler and database threads
    (10 % of the event loop's samples at 512 tenants, `bench/load.py` with py-spy). The ids only tie a
    response to its log lines, so unique is enough; unguessable is not needed."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._counter = itertools.count()

    def mint(self) -> str:
        return f"{self._prefix}{next(self._counter) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def _request_id(scope: Scope, ids: RequestIds) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            candidate = value.decode("latin-1")
            if _SANE_REQUEST_ID.fullmatch(candidate):
                return candidate
    return ids.mint()


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _tagging_send(send: Send, request_id: str, status: dict[str, Any]) -> Send:
    async def tagged(message: Message) -> None:
        if message["type"] == "http.response.start":
            status["code"] = message["status"]
            status["started"] = True
            headers = list(message.get("headers", []))
            headers.append((REQUEST_ID_HEADER.lower().encode(), request_id.encode()))
            message = {**message, "headers": headers}
        await send(message)

    return tagged


def _limited_receive(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def limited() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    return limited
