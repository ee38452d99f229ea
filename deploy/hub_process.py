"""The hub worker that `carpool cluster up` runs beside its gateway: one `carpool hub-worker` child process.

Cluster gateways only queue hub pushes (Celery on the Redis broker); without a consumer they would stay
`queued` forever. `cluster up` is the whole cluster on one box, so it starts one hub worker with its own
settings and stops it on shutdown. It is a separate process, not a thread, because a Celery worker owns
its process (signal handlers, its own pool) and must not share the gateway's event loop.

The child gets this process's environment plus what `cluster up` decided itself (the database it created
or picked, the data directory from `--data-dir`); `CARPOOL_METRICS_PORT` is dropped so the child does not
compete for the gateway's port. Stopping sends SIGTERM (Celery's warm shutdown: a running push may
finish) and kills after `stop_timeout_s`; `acks_late` redelivers a push cut short that way.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from deploy.settings import ClusterSettings

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
_NOT_INHERITED = ("CARPOOL_METRICS_PORT",)


def hub_worker_command(concurrency: int = 2) -> list[str]:
    """`carpool hub-worker` through this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "deploy.cli", "hub-worker", "--concurrency", str(concurrency)]


def hub_worker_env(settings: ClusterSettings, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `base` (default: ours) with the settings `cluster up` resolved itself."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _NOT_INHERITED}
    if settings.database_url:
        env["CARPOOL_DATABASE_URL"] = settings.database_url
    env["CARPOOL_DATA_DIR"] = str(settings.data_dir)
    return env


class HubWorkerProcess:
    """One `carpool hub-worker` child: `start()`, `running`, `stop()`."""

    def __init__(self, settings: ClusterSettings, *, concurrency: int = 2, log_file: Path | None = None,
                 stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        self._settings = settings
        self._concurrency = concurrency
        self._log_file = log_file
        self._stop_timeout_s = stop_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        if self._process is not None:
            return
        output = None if self._log_file is None else self._log_file.open("ab")
        try:  # without a log file the child writes to our stdout/stderr, next to the gateway's log
            self._process = subprocess.Popen(hub_worker_command(self._concurrency),
                                             env=hub_worker_env(self._settings), stdout=output,
                                             stderr=subprocess.STDOUT if output is not None else None)
        finally:
            if output is not None:
                output.close()
        log.info("hub worker started (pid %d)", self._process.pid)

    def stop(self) -> int | None:
        """Stop the child (SIGTERM, then SIGKILL after the timeout); returns its exit code."""
        process, self._process = self._process, None
        if process is None:
            return None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("hub worker did not stop within %.0f s; killing it", self._stop_timeout_s)
                process.kill()
                process.wait()
        elif process.returncode != 0:
            log.warning("hub worker had exited with code %d; pushes stayed queued", process.returncode)
        return process.returncode
