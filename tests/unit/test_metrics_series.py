"""Prometheus series: what the loops and the gateway record, how a process serves them, and the Grafana board.

The board test parses `deploy/grafana/carpool.json` and fails when any PromQL expression names a series
that no Carpool process exports (a renamed metric would otherwise leave a silently empty panel).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

from services.control.api import RuntimeStats
from services.domain.training import WorkError
from services.metrics import (
    GatewayMetrics,
    ProcessMetrics,
    ReplicaSample,
    RuntimeStatsCollector,
    render,
    start_metrics_server,
)
from services.runtime.reporting import LoopCounters
from services.scheduler.requests import Completion, QueuedRequest, RequestKind

BOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "carpool.json"
SERIES = re.compile(r"\bcarpool_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def every_series() -> tuple[set[str], CollectorRegistry]:
    """All sample names a process can export: gateway, runtime (per-tenant on), residency, snapshots."""
    metrics = ProcessMetrics.create(per_tenant=True)
    GatewayMetrics(metrics.registry)
    metrics.registry.register(RuntimeStatsCollector(lambda: [RuntimeStats("m", True)]))
    metrics.add_replicas(lambda: [ReplicaSample("m", "r0", 1, 2, spills=0, reloads=0, memory_bytes=1)])
    names = {family.name + suffix for family in metrics.registry.collect()
             for suffix in SUFFIXES.get(family.type, ("",))}
    return names, metrics.registry


def board_expressions() -> list[str]:
    board = json.loads(BOARD.read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    return exprs


def test_every_board_expression_names_exported_series() -> None:
    exported, _ = every_series()
    exprs = board_expressions()
    assert len(exprs) >= 20
    unknown = {(name, expr) for expr in exprs for name in SERIES.findall(expr) if name not in exported}
    assert not unknown, sorted(unknown)
    named = {name for expr in exprs for name in SERIES.findall(expr)}
    # The board covers the rows: traffic, queue wait, tokens/s, packing, residency, errors, tenants.
    for series in ("carpool_http_request_duration_seconds_bucket", "carpool_queue_wait_seconds_bucket",
                   "carpool_tokens_trained_total", "carpool_pass_adapters_sum", "carpool_adapters_resident",
                   "carpool_request_errors_total", "carpool_tenant_tokens_trained_total",
                   "carpool_scheduler_lease_held"):
        assert series in named, series


def test_names_follow_the_prometheus_conventions() -> None:
    exported, _ = every_series()
    assert all(name.startswith("carpool_") for name in exported)
    counters = {n for n in exported if n.endswith("_total")}
    assert "carpool_http_requests_total" in counters and "carpool_adapter_spills_total" in counters
    assert not any(n.endswith(("_ms", "_milliseconds", "_kb")) for n in exported)


def request(kind: RequestKind, tenant: str, tokens: int, enqueued_at: float) -> QueuedRequest:
    return QueuedRequest(request_id=f"r-{tenant}-{kind.value}", tenant_id=tenant, model_id=f"m-{tenant}",
                         kind=kind, seq_id=1, num_tokens=tokens, enqueued_at=enqueued_at)


def test_loop_counters_feed_the_base_models_series() -> None:
    metrics = ProcessMetrics.create(per_tenant=True)
    counters = LoopCounters("tiny", metrics.runtime.for_model("tiny"))
    a = request(RequestKind.FORWARD_BACKWARD, "acme", 100, enqueued_at=1.0)
    b = request(RequestKind.FORWARD_BACKWARD, "bolt", 50, enqueued_at=1.0)
    counters.series.started([(a.kind.value, a.enqueued_at), (b.kind.value, 0.0)], now=3.5)
    counters.record_pass(150, tenants=2, seconds=0.2, adapters=2)
    counters.record_barrier(0.01, "optim_step")
    counters.record_completions([Completion(a, object()), Completion(b, WorkError("bad input", "user"))])

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    wait = {"base_model": "tiny", "kind": "forward_backward"}
    assert value("carpool_queue_wait_seconds_count", **wait) == 1  # b had no submission time: not observed
    assert value("carpool_queue_wait_seconds_sum", **wait) == 2.5
    assert value("carpool_pass_adapters_sum", base_model="tiny") == 2
    assert value("carpool_pass_tokens_bucket", base_model="tiny", le="256.0") == 1
    assert value("carpool_tokens_trained_total", base_model="tiny") == 150
    assert value("carpool_optimizer_steps_total", base_model="tiny") == 1
    assert value("carpool_request_errors_total", base_model="tiny", category="user") == 1
    assert value("carpool_request_errors_total", base_model="tiny", category="server") == 0
    assert value("carpool_tenant_tokens_trained_total", tenant="acme", base_model="tiny") == 100
    assert value("carpool_tenant_tokens_trained_total", tenant="bolt", base_model="tiny") is None  # it failed
    assert counters.snapshot(True).passes == 1  # the snapshot counters still count as before


def test_per_tenant_series_only_when_asked() -> None:
    metrics = ProcessMetrics.create(per_tenant=False)
    counters = LoopCounters("tiny", metrics.runtime.for_model("tiny"))
    counters.record_completions([Completion(request(RequestKind.FORWARD_BACKWARD, "acme", 10, 1.0), object())])
    assert b"tenant=" not in render(metrics.registry)
    assert metrics.registry.get_sample_value("carpool_requests_finished_total", {
        "base_model": "tiny", "kind": "forward_backward", "outcome": "done"}) == 1


def test_a_metrics_port_serves_the_registry() -> None:
    metrics = ProcessMetrics.create()
    metrics.runtime.for_model("tiny").lease(True)
    server = start_metrics_server(metrics.registry, host="127.0.0.1", port=0)
    try:
        text = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).text
    finally:
        server.close()
    assert 'carpool_scheduler_lease_held{base_model="tiny"} 1.0' in text
