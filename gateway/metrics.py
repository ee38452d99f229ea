"""Per-route request metrics: counts by status, a latency histogram, requests in flight.

Kept in process (one `RouteMetrics` per app, in `app.state.metrics`) and rendered in the Prometheus
text format at `/metrics`. Routes are labelled by their template (`/api/v1/samplers/{sampler_id:path}`),
never the raw path, so ids cannot blow up the label set; unmatched paths share one label.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

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
    escaped = route.replace("\\", "\\\\").replace('"', '\\"')
    return f'method="{method}",route="{escaped}"'


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
