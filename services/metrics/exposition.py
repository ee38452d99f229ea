"""Rendering a registry in the Prometheus text format, and the metrics port of processes without HTTP.

The gateway serves `render(registry)` at `/metrics` on its own port; a scheduler or hub worker, which
serve no HTTP otherwise, call `start_metrics_server` (prometheus_client's threaded server) on the port
the operator configured, and `close()` it on shutdown.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, start_http_server

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
