"""The ASGI middleware at the edge of every request: request id, body-size limit, metrics, last-resort 500.

A plain ASGI class (not `BaseHTTPMiddleware`, which buffers and interferes with long-polls). It
- tags the request with an id (a sane incoming `X-Request-Id`, else a fresh one), echoed on the answer
  and available as `request.state.request_id`;
- answers 413 before reading a body whose `Content-Length` is over the limit, and makes `receive`
  raise `BodyTooLarge` when a streamed body crosses it (the route's handler turns that into a 413);
- records per-route counts and latency in `RouteMetrics`;
- turns an unexpected exception into a JSON 500 that says nothing about internals (the traceback is
  logged with the request id; headers are never logged).

`RouteMetrics` (one per app, `app.state.metrics`) is rendered in the Prometheus text format at `/metrics`,
followed by the control plane's scheduler counters (`render_runtime`) when it exposes them. Routes are
labelled by their template (`/api/v1/samplers/{sampler_id:path}`), never the raw path, so ids cannot blow
up the label set; unmatched paths share one label.
"""

from __future__ import annotations

import bisect
import logging
import re
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import BodyTooLarge, body_too_large_response, error_response
from services.control.api import RuntimeStats

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class EdgeMiddleware:
    """See the module docstring."""

    def __init__(self, app: ASGIApp, *, metrics: RouteMetrics, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
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
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await body_too_large_response(self.max_body_bytes)(scope, receive, send)
            return
        try:
            await self.app(scope, _limited_receive(receive, self.max_body_bytes), send)
        except Exception:
            log.exception("unhandled error in %s %s (request id %s)", scope["method"], scope["path"],
                          scope["state"]["request_id"])
            if status["started"]:
                raise
            response = error_response(500, "internal server error", request_id=scope["state"]["request_id"])
            await response(scope, receive, send)


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            candidate = value.decode("latin-1")
            if _SANE_REQUEST_ID.fullmatch(candidate):
                return candidate
    return uuid.uuid4().hex


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


# -- metrics ------------------------------------------------------------------------------------------
LATENCY_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Upper bounds of the latency histogram; long-polls land in the 30 s bucket by design."""
UNMATCHED_ROUTE = "<unmatched>"

RouteKey = tuple[str, str]
"""(method, route template)."""


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    total: int = 0
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        index = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
        if index < len(self.counts):
            self.counts[index] += 1
        self.total += 1
        self.sum_s += seconds


class RouteMetrics:
    """Counters for one app; single event loop, so no locking."""

    def __init__(self) -> None:
        self._requests: defaultdict[tuple[str, str, int], int] = defaultdict(int)
        self._latency: defaultdict[RouteKey, _Histogram] = defaultdict(_Histogram)
        self._in_flight = 0

    def started(self) -> None:
        self._in_flight += 1

    def finished(self, method: str, route: str, status: int, seconds: float) -> None:
        self._in_flight -= 1
        self._requests[(method, route, status)] += 1
        self._latency[(method, route)].observe(seconds)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def count(self, method: str, route: str, status: int | None = None) -> int:
        """Requests seen for a route (optionally only those answered with `status`)."""
        return sum(n for (m, r, s), n in self._requests.items() if m == method and r == route
                   and (status is None or s == status))

    def render(self) -> str:
        """Prometheus text exposition (format 0.0.4)."""
        lines = [
            "# HELP carpool_http_requests_total HTTP requests by method, route template and status.",
            "# TYPE carpool_http_requests_total counter",
        ]
        for (method, route, status), n in sorted(self._requests.items()):
            lines.append(f'carpool_http_requests_total{{{_labels(method, route)},status="{status}"}} {n}')
        lines += [
            "# HELP carpool_http_request_duration_seconds Time from request start to response end.",
            "# TYPE carpool_http_request_duration_seconds histogram",
        ]
        for (method, route), hist in sorted(self._latency.items()):
            lines.extend(_histogram_lines(_labels(method, route), hist))
        lines += [
            "# HELP carpool_http_requests_in_flight Requests being handled now (long-polls included).",
            "# TYPE carpool_http_requests_in_flight gauge",
            f"carpool_http_requests_in_flight {self._in_flight}",
        ]
        return "\n".join(lines) + "\n"


def _labels(method: str, route: str) -> str:
    return f'method="{method}",route="{_escape(route)}"'


def _histogram_lines(labels: str, hist: _Histogram) -> list[str]:
    name = "carpool_http_request_duration_seconds"
    lines = []
    cumulative = 0
    for bound, n in zip(LATENCY_BUCKETS_S, hist.counts, strict=True):
        cumulative += n
        lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
    lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {hist.total}')
    lines.append(f"{name}_sum{{{labels}}} {hist.sum_s:.6f}")
    lines.append(f"{name}_count{{{labels}}} {hist.total}")
    return lines


RUNTIME_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("passes", "counter", "Engine passes run."),
    ("multi_tenant_passes", "counter", "Passes that carried more than one tenant's requests."),
    ("tenants_per_pass_total", "counter", "Sum over passes of their tenant count."),
    ("tokens", "counter", "Tokens processed by forward/backward passes."),
    ("barriers", "counter", "Barriers run (optim_step, saves, loads)."),
    ("sample_batches", "counter", "Sampling batches run."),
    ("requests_completed", "counter", "Requests finished successfully."),
    ("requests_failed", "counter", "Requests finished with an error."),
    ("busy_seconds", "counter", "Seconds spent running passes."),
    ("last_pass_tokens_per_s", "gauge", "Throughput of the last pass."),
    ("queued", "gauge", "Requests waiting in the queue or the scheduler."),
)


def render_runtime(stats: Sequence[RuntimeStats]) -> str:
    """The scheduler loops' counters (when the control plane exposes them) in Prometheus text."""
    lines: list[str] = []
    for field_name, kind, help_text in RUNTIME_COUNTERS:
        metric = f"carpool_runtime_{field_name}"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"]
        for s in stats:
            lines.append(f'{metric}{{base_model="{_escape(s.base_model)}"}} {getattr(s, field_name)}')
    lines += ["# HELP carpool_runtime_running Whether the base model's scheduler loop runs.",
              "# TYPE carpool_runtime_running gauge"]
    lines += [f'carpool_runtime_running{{base_model="{_escape(s.base_model)}"}} {int(s.running)}' for s in stats]
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')
