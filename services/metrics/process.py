"""`ProcessMetrics`: what one process exposes at its `/metrics`, assembled by the composition root.

A gateway-only process (cluster gateway, tests) gets a fresh one from the app factory; `carpool serve`
(embedded) and `carpool cluster up` build one, give its `runtime` to the scheduler loops, add the
residency readers of their engines or replica pools, and pass it to the gateway so that everything the
process does lands on one page. `carpool scheduler` serves its own on `metrics_port`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, disable_created_metrics

from services.metrics.collectors import ReplicaSample, ResidencyCollector
from services.metrics.runtime import RuntimeMetrics

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
