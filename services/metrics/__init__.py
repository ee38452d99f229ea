"""Carpool's Prometheus series: their definitions, the collectors that read live state, and the exposition.

Built on `prometheus_client` with an explicit `CollectorRegistry` per process (no import-time global):
the composition root (`deploy`) makes one, hands it to the gateway (`GatewayMetrics`), the scheduler
loops (`RuntimeMetrics`) and the collectors, and serves it at `/metrics` (gateway port) or on a metrics
port of its own (schedulers, hub workers). Nothing here imports a web framework.
"""

from services.metrics.process import (
    CONTENT_TYPE,
    GroupCommitCollector,
    MetricsServer,
    ProcessMetrics,
    ReplicaSample,
    ResidencyCollector,
    RuntimeStatsCollector,
    render,
    start_metrics_server,
)
from services.metrics.series import GatewayMetrics, ModelSeries, RuntimeMetrics

__all__ = [
    "CONTENT_TYPE",
    "GatewayMetrics",
    "GroupCommitCollector",
    "MetricsServer",
    "ModelSeries",
    "ProcessMetrics",
    "ReplicaSample",
    "ResidencyCollector",
    "RuntimeMetrics",
    "RuntimeStatsCollector",
    "render",
    "start_metrics_server",
]
