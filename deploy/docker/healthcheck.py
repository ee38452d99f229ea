"""Docker HEALTHCHECK of the Carpool images: checks whatever process the container runs.

One image serves several commands (gateway, scheduler, hub worker, Ray worker), so the check reads the
container's main command (PID 1) and asks that process: the gateway's /api/v1/healthz, a scheduler's or
hub worker's /metrics (when CARPOOL_METRICS_PORT is set), the local raylet's health endpoint on Ray pods.
Exit 0: healthy; 1: not. Kubernetes does not run this (the chart declares its own probes).
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

RAYLET_HEALTH = "http://127.0.0.1:52365/api/local_raylet_healthz"


def main_command() -> list[str]:
    """PID 1's argv (the container's command)."""
    try:
        raw = Path("/proc/1/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def health_url(argv: list[str]) -> str | None:
    """The URL that tells this container's process is healthy; None when there is nothing to ask."""
    words = set(argv)
    if "serve" in words:
        return f"http://127.0.0.1:{os.environ.get('CARPOOL_PORT', '8000')}/api/v1/healthz"
    if words & {"scheduler", "hub-worker"}:
        port = os.environ.get("CARPOOL_METRICS_PORT")
        return f"http://127.0.0.1:{port}/metrics" if port else None
    if "worker" in words or any("ray start" in word for word in argv):
        return RAYLET_HEALTH
    return None


def healthy(url: str | None) -> bool:
    if url is None:
        return True
    try:
        with urllib.request.urlopen(url, timeout=8) as response:
            return 200 <= response.status < 300
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(0 if healthy(health_url(main_command())) else 1)
