"""One process's metrics: its registry (`ProcessMetrics`), its exposition, and reading its histograms back.

A gateway-only process (cluster gateway, tests) gets a fresh `ProcessMetrics` from the app factory;
`carpool serve` (embedded) and `carpool cluster up` build one, give its `runtime` to the scheduler loops,
add the residency readers of their engines or replica pools, and pass it to the gateway so that everything
the process does lands on one page. The gateway serves `render(registry)` at `/metrics` on its own port; a
scheduler or hub worker, which serve no HTTP otherwise, call `start_metrics_server` on the port the operator
configured. The dashboard's overview reads quantiles and means back from the process's own histograms
(`histogram_quantile`, `histogram_mean`): useful where no Prometheus is deployed; values are since the
process started (Prometheus, with `rate()`, shows recent windows instead).

The collectors read live state at scrape time: counters that already exist elsewhere (the loops'
`RuntimeStats`, an engine's spill count, a pool's placement map) are not mirrored into metric objects on
every change, so the hot path pays nothing and the numbers cannot drift from their source.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.control.api import RuntimeStats
from services.db.group_commit import GroupStats
from services.metrics.series import RuntimeMetrics

# -- collectors -------------------------------------------------------------------------------------
RUNTIME_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("passes", "counter", "Engine passes run."),
    ("multi_tenant_passes", "counter", "Passes that carried more than one tenant's requests."),
    ("tenants_per_pass", "counter", "Sum over passes of their tenant count."),
    ("tokens", "counter", "Tokens processed by forward/backward passes."),
    ("barriers", "counter", "Barriers run (optim_step, saves, loads)."),
    ("sample_batches", "counter", "Sampling batches run."),
    ("requests_completed", "counter", "Requests finished successfully."),
    ("requests_failed", "counter", "Requests finished with an error."),
    ("busy_seconds", "counter", "Seconds spent running passes."),
    ("last_pass_tokens_per_s", "gauge", "Throughput of the last pass."),
    ("queued", "gauge", "Requests waiting in the queue or the scheduler."),
)
"""`carpool_runtime_<name>` series from the active scheduler's `RuntimeStats` (any gateway can serve them)."""
_ATTRIBUTE = {"tenants_per_pass": "tenants_per_pass_total"}


class RuntimeStatsCollector(Collector):
    """`carpool_runtime_*{base_model}` from `stats()`: each base model's scheduler counters as last seen."""

    def __init__(self, stats: Callable[[], Sequence[RuntimeStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        snapshots = list(self._stats())
        for name, kind, doc in RUNTIME_FIELDS:
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_type(f"carpool_runtime_{name}", doc, labels=["base_model"])
            for s in snapshots:
                family.add_metric([s.base_model], float(getattr(s, _ATTRIBUTE.get(name, name))))
            yield family
        running = GaugeMetricFamily("carpool_runtime_running", "Whether the base model's scheduler loop runs.",
                                    labels=["base_model"])
        for s in snapshots:
            running.add_metric([s.base_model], float(s.running))
        yield running


@dataclass(frozen=True)
class ReplicaSample:
    """One worker replica of a base model as its owner sees it now."""

    base_model: str
    replica: str
    resident_adapters: int
    """Adapters whose weights are in the replica's accelerator (or compute) memory."""
    known_adapters: int
    """Resident plus spilled ones."""
    spills: int | None = None
    reloads: int | None = None
    memory_bytes: int | None = None


class ResidencyCollector(Collector):
    """`carpool_adapters_resident`, spills, reloads and memory per replica, from `replicas()`."""

    def __init__(self, replicas: Callable[[], Sequence[ReplicaSample]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        samples = list(self._replicas())
        labels = ["base_model", "replica"]
        resident = GaugeMetricFamily("carpool_adapters_resident", "Adapters resident in a replica's memory.",
                                     labels=labels)
        known = GaugeMetricFamily("carpool_adapters_known", "Adapters a replica holds, resident or spilled.",
                                  labels=labels)
        spills = CounterMetricFamily("carpool_adapter_spills", "Adapters moved out of replica memory.",
                                     labels=labels)
        reloads = CounterMetricFamily("carpool_adapter_reloads", "Spilled adapters brought back.", labels=labels)
        memory = GaugeMetricFamily("carpool_replica_memory_bytes", "Memory a replica's process uses.",
                                   labels=labels)
        for s in samples:
            key = [s.base_model, s.replica]
            resident.add_metric(key, s.resident_adapters)
            known.add_metric(key, s.known_adapters)
            if s.spills is not None:
                spills.add_metric(key, s.spills)
            if s.reloads is not None:
                reloads.add_metric(key, s.reloads)
            if s.memory_bytes is not None:
                memory.add_metric(key, s.memory_bytes)
        yield from (resident, known, spills, reloads, memory)


class GroupCommitCollector(Collector):
    """`carpool_db_group_commit_*`: the submissions' group commit (jobs ÷ groups is its mean group size)."""

    def __init__(self, stats: Callable[[], GroupStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:  # off (PostgreSQL by default): no series rather than zeros that look like idle
            return
        yield CounterMetricFamily("carpool_db_group_commit_groups", "Transactions the group committer ran.",
                                  value=stats.groups)
        yield CounterMetricFamily("carpool_db_group_commit_jobs", "Submissions' write transactions it ran in them.",
                                  value=stats.jobs)
        yield CounterMetricFamily("carpool_db_group_commit_failures", "Groups whose BEGIN or COMMIT failed.",
                                  value=stats.commit_failures)


# -- the process's registry -------------------------------------------------------------------------
ReplicaSource = Callable[[], Sequence[ReplicaSample]]


@dataclass
class ProcessMetrics:
    """The registry of one process, its runtime series, and where replica residency is read from."""

    registry: CollectorRegistry
    runtime: RuntimeMetrics
    replica_sources: list[ReplicaSource] = field(default_factory=list)

    @classmethod
    def create(cls, *, per_tenant: bool = False) -> ProcessMetrics:
        # `*_created` timestamps double the page for no use on a dashboard; prometheus_client keeps this
        # switch process-wide, which matches its scope here (one registry per process).
        disable_created_metrics()
        registry = CollectorRegistry()
        metrics = cls(registry, RuntimeMetrics(registry, per_tenant=per_tenant))
        registry.register(ResidencyCollector(metrics.replicas))
        return metrics

    def add_replicas(self, source: ReplicaSource) -> None:
        self.replica_sources.append(source)

    def replicas(self) -> list[ReplicaSample]:
        """Every replica this process knows of now (the dashboard's Workers page reads it too)."""
        return [sample for source in self.replica_sources for sample in source()]


# -- exposition -------------------------------------------------------------------------------------
CONTENT_TYPE = CONTENT_TYPE_LATEST


def render(registry: CollectorRegistry) -> bytes:
    """The registry's current samples in the Prometheus text exposition format."""
    return generate_latest(registry)


@dataclass
class MetricsServer:
    """A running metrics port; `port` is the one bound (useful when 0 asked for a free one)."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(registry: CollectorRegistry, *, host: str, port: int) -> MetricsServer:
    """Serve `registry` at `http://host:port/metrics` from a daemon thread."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)


# -- reading histograms back ------------------------------------------------------------------------
def _buckets(registry: CollectorRegistry, name: str, match: dict[str, str]) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of `name`'s buckets, summed over series whose labels include `match`."""
    totals: defaultdict[float, float] = defaultdict(float)
    for family in registry.collect():
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_bucket" and all(sample.labels.get(k) == v for k, v in match.items()):
                totals[float(sample.labels["le"])] += sample.value
    return sorted(totals.items())


def histogram_quantile(registry: CollectorRegistry, name: str, q: float, **match: str) -> float | None:
    """Prometheus' `histogram_quantile` over the cumulative buckets; None without observations."""
    buckets = _buckets(registry, name, match)
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def histogram_mean(registry: CollectorRegistry, name: str, **match: str) -> float | None:
    total = count = 0.0
    for family in registry.collect():
        if family.name != name:
            continue
        for sample in family.samples:
            if all(sample.labels.get(k) == v for k, v in match.items()):
                if sample.name == f"{name}_sum":
                    total += sample.value
                elif sample.name == f"{name}_count":
                    count += sample.value
    return total / count if count else None
