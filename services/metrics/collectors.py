"""Collectors that read live state at scrape time: scheduler snapshots and adapter residency per replica.

Counters that already exist elsewhere (the loops' `RuntimeStats`, an engine's spill count, a pool's
placement map) are not mirrored into metric objects on every change: these collectors ask for them when
Prometheus scrapes, so the hot path pays nothing and the numbers cannot drift from their source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.control.api import RuntimeStats

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
