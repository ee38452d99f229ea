"""The gateway's series: requests by route template, method and status; latency; long-polls; auth failures.

Routes are labelled by their template (`/api/v1/samplers/{sampler_id:path}`), never the raw path, so ids
cannot grow the label set; unmatched paths share one label. The middleware and the auth dependency call
these methods; the objects are registered on the registry given (None: kept private, e.g. in tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Upper bounds of the latency histogram; long-polls land in the 30 s bucket by design."""
UNMATCHED_ROUTE = "<unmatched>"
AUTH_FAILURE_REASONS = ("missing", "malformed", "rejected", "forbidden")
"""Bounded: missing credential, unusable header, unknown/revoked/disabled key, non-admin on an admin route."""


class GatewayMetrics:
    """Request counters and latency histograms of one gateway process."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.requests = Counter(
            "carpool_http_requests", "HTTP requests by method, route template and status.",
            ["method", "route", "status"], registry=registry)
        self.duration = Histogram(
            "carpool_http_request_duration_seconds", "Time from request start to response end.",
            ["method", "route"], buckets=LATENCY_BUCKETS_S, registry=registry)
        self.in_flight = Gauge(
            "carpool_http_requests_in_flight", "Requests being handled now (long-polls included).",
            registry=registry)
        self.long_polls = Gauge(
            "carpool_long_polls_in_flight", "Future retrievals waiting for their result now.", registry=registry)
        self.auth_failures = Counter(
            "carpool_auth_failures", "Requests refused for their credential, by reason.", ["reason"],
            registry=registry)
        for reason in AUTH_FAILURE_REASONS:  # present at 0 from the start, so rate() works at once
            self.auth_failures.labels(reason)

    def started(self) -> None:
        self.in_flight.inc()

    def finished(self, method: str, route: str, status: int, seconds: float) -> None:
        self.in_flight.dec()
        self.requests.labels(method, route, str(status)).inc()
        self.duration.labels(method, route).observe(seconds)

    def auth_failed(self, reason: str) -> None:
        self.auth_failures.labels(reason if reason in AUTH_FAILURE_REASONS else "rejected").inc()
