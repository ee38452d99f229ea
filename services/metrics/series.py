"""Carpool's series: the gateway's (requests, latency, long-polls, auth failures) and the runtime's, per base model.

`GatewayMetrics` is what the HTTP edge records: requests by route template (never the raw path, so ids
cannot grow the label set; unmatched paths share one label), method and status, and latency.
`RuntimeMetrics` owns the scheduler's and worker's objects of one process; `for_model(name)` binds them to a
base model (`ModelSeries`), which the scheduler loop's dispatcher and counters call as work runs. Label sets
are bounded: base model, request kind, error category, hub and outcome. Per-tenant series (`tenant` label)
exist only when `per_tenant` is set, since their cardinality grows with the number of tenants. Objects are
registered on the registry given (None: kept private, e.g. a loop built without a process registry).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

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


QUEUE_WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
PASS_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
COUNT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
ERROR_CATEGORIES = ("user", "server", "unknown")
HUB_OUTCOMES = ("done", "failed")
LOOP_CPU_PARTS = ("pass", "sample_batch", "barrier", "bookkeeping", "planning")
"""What a scheduler loop's thread spends its CPU on: the backend's three kinds of call, then the per-request
overhead around them (bookkeeping: recording, storing and announcing results; planning: claiming, admitting,
the scheduler's step and its completion)."""


class RuntimeMetrics:
    """All runtime series of one process (register them by passing the process registry)."""

    def __init__(self, registry: CollectorRegistry | None, *, per_tenant: bool = False) -> None:
        def histogram(name: str, doc: str, labels: list[str], buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.queue_wait = histogram("carpool_queue_wait_seconds", "Time from submission to the start of the "
                                    "pass that ran the request.", ["base_model", "kind"], QUEUE_WAIT_BUCKETS_S)
        self.queue_depth = Gauge("carpool_queue_depth", "Requests waiting in the queue or the scheduler.",
                                 ["base_model"], registry=registry)
        self.pass_duration = histogram("carpool_pass_duration_seconds", "Wall time of a packed "
                                       "forward/backward pass.", ["base_model"], PASS_SECONDS_BUCKETS)
        self.pass_tokens = histogram("carpool_pass_tokens", "Tokens in a packed pass.", ["base_model"],
                                     TOKEN_BUCKETS)
        self.pass_adapters = histogram("carpool_pass_adapters", "LoRA adapters in a packed pass.",
                                       ["base_model"], COUNT_BUCKETS)
        self.pass_tenants = histogram("carpool_pass_tenants", "Tenants in a packed pass.", ["base_model"],
                                      COUNT_BUCKETS)
        self.tokens_trained = counter("carpool_tokens_trained", "Tokens run through forward/backward.",
                                      ["base_model"])
        self.tokens_sampled = counter("carpool_tokens_sampled", "Tokens generated by sampling.", ["base_model"])
        self.optimizer_steps = counter("carpool_optimizer_steps", "Optimizer steps applied.", ["base_model"])
        self.barriers = counter("carpool_barriers", "Barrier operations run (steps, saves, loads), by kind.",
                                ["base_model", "kind"])
        self.requests_finished = counter("carpool_requests_finished", "Requests finished, by kind and outcome "
                                         "(done or failed).", ["base_model", "kind", "outcome"])
        self.errors = counter("carpool_request_errors", "Failed requests by error category (user, server, "
                              "unknown).", ["base_model", "category"])
        self.loop_cpu = counter("carpool_scheduler_loop_cpu_seconds", "CPU time of a scheduler loop's thread, "
                                "by part: pass, sample_batch and barrier (the backend's calls), bookkeeping "
                                "(recording, storing and announcing results) and planning (claiming, admitting, "
                                "the scheduler's step).", ["base_model", "part"])
        self.lease_held = Gauge("carpool_scheduler_lease_held", "1 while this scheduler process holds the "
                                "base model's lease (cluster mode; always 1 embedded).", ["base_model"],
                                registry=registry)
        self.hub_pushes = counter("carpool_hub_pushes", "Checkpoint pushes to a model hub, by hub (hf, ms) "
                                  "and outcome (done, failed).", ["hub", "outcome"])
        self.tenants: TenantSeries | None = TenantSeries(registry) if per_tenant else None
        for hub in ("hf", "ms"):  # present at 0, so a failed-push alert has a series to read
            for outcome in HUB_OUTCOMES:
                self.hub_pushes.labels(hub, outcome)

    def for_model(self, base_model: str) -> ModelSeries:
        return ModelSeries(self, base_model)

    def hub_push_finished(self, hub: str, outcome: str) -> None:
        self.hub_pushes.labels(hub, outcome if outcome in HUB_OUTCOMES else "failed").inc()


class TenantSeries:
    """Per-tenant usage series: opt in (`CARPOOL_METRICS_PER_TENANT`), one series per tenant and model."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.tokens_trained = Counter("carpool_tenant_tokens_trained", "Tokens trained, per tenant.",
                                      ["tenant", "base_model"], registry=registry)
        self.tokens_sampled = Counter("carpool_tenant_tokens_sampled", "Tokens sampled, per tenant.",
                                      ["tenant", "base_model"], registry=registry)
        self.requests = Counter("carpool_tenant_requests", "Requests finished, per tenant and kind.",
                                ["tenant", "base_model", "kind"], registry=registry)


class ModelSeries:
    """The series of one base model, bound once (label lookups are not free on the hot path)."""

    def __init__(self, metrics: RuntimeMetrics, base_model: str) -> None:
        self._m = metrics
        self.base_model = base_model
        self._pass_duration = metrics.pass_duration.labels(base_model)
        self._pass_tokens = metrics.pass_tokens.labels(base_model)
        self._pass_adapters = metrics.pass_adapters.labels(base_model)
        self._pass_tenants = metrics.pass_tenants.labels(base_model)
        self._trained = metrics.tokens_trained.labels(base_model)
        self._sampled = metrics.tokens_sampled.labels(base_model)
        self._steps = metrics.optimizer_steps.labels(base_model)
        self._depth = metrics.queue_depth.labels(base_model)
        self._loop_cpu = {part: metrics.loop_cpu.labels(base_model, part) for part in LOOP_CPU_PARTS}
        for category in ERROR_CATEGORIES:  # present at 0, so an error-rate alert has a series to read
            metrics.errors.labels(base_model, category)
        metrics.lease_held.labels(base_model)

    def started(self, waits: Iterable[tuple[str, float]], now: float | None = None) -> None:
        """Requests (kind, enqueued_at on the monotonic clock) start running now."""
        now = time.monotonic() if now is None else now
        for kind, enqueued_at in waits:
            if enqueued_at > 0:  # 0: a request built without a submission time (tools, tests)
                self._m.queue_wait.labels(self.base_model, kind).observe(max(0.0, now - enqueued_at))

    def packed_pass(self, *, tokens: int, adapters: int, tenants: int, seconds: float) -> None:
        self._pass_duration.observe(seconds)
        self._pass_tokens.observe(tokens)
        self._pass_adapters.observe(adapters)
        self._pass_tenants.observe(tenants)
        self._trained.inc(tokens)

    def sampled(self, tokens: int) -> None:
        self._sampled.inc(tokens)

    def barrier(self, kind: str) -> None:
        self._m.barriers.labels(self.base_model, kind).inc()
        if kind == "optim_step":
            self._steps.inc()

    def finished(self, tenant: str, kind: str, error_category: str | None, tokens: int) -> None:
        """One request ended (`error_category` None: it succeeded)."""
        outcome = "done" if error_category is None else "failed"
        self._m.requests_finished.labels(self.base_model, kind, outcome).inc()
        if error_category is not None:
            category = error_category if error_category in ERROR_CATEGORIES else "unknown"
            self._m.errors.labels(self.base_model, category).inc()
        tenants = self._m.tenants
        if tenants is not None:
            tenants.requests.labels(tenant, self.base_model, kind).inc()
            if error_category is None and tokens:
                series = tenants.tokens_sampled if kind == "sample" else tenants.tokens_trained
                series.labels(tenant, self.base_model).inc(tokens)

    def queue(self, depth: int) -> None:
        self._depth.set(depth)

    def loop_cpu(self, part: str, seconds: float) -> None:
        """The loop thread spent `seconds` of CPU on `part` (one of `LOOP_CPU_PARTS`)."""
        self._loop_cpu[part].inc(max(0.0, seconds))

    def lease(self, held: bool) -> None:
        self._m.lease_held.labels(self.base_model).set(int(held))
