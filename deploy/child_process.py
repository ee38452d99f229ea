"""`ChildProcess`: one process that `carpool cluster up` starts beside its gateway and stops with it.

`cluster up` is the whole cluster on one box. Parts that own their process (a Celery hub worker) or that
must not share the gateway's GIL (a scheduler with `CARPOOL_SCHEDULER_PROCESSES`) run as children started
through this interpreter (`python -m deploy.cli ...`, so no console script need be on PATH), with the
environment `child_env` builds: this process's, plus what `cluster up` resolved itself (the database it
created or picked, the data directory from `--data-dir`, the base models from `--base-model`), minus
`CARPOOL_METRICS_PORT`, which is the gateway's. Stopping sends SIGTERM (each child shuts down cleanly on it)
and kills after the timeout.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from deploy.settings import ClusterSettings

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
_NOT_INHERITED = ("CARPOOL_METRICS_PORT",)


def carpool_command(*args: str) -> list[str]:
    """`carpool ARGS...` through this interpreter."""
    return [sys.executable, "-m", "deploy.cli", *args]


def child_env(settings: ClusterSettings, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: `base` (default: ours) with the settings `cluster up` resolved itself."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _NOT_INHERITED}
    if settings.database_url:
        env["CARPOOL_DATABASE_URL"] = settings.database_url
    env["CARPOOL_DATA_DIR"] = str(settings.data_dir)
    env["CARPOOL_BASE_MODELS"] = json.dumps(list(settings.base_models))
    return env


class ChildProcess:
    """One child: `start()`, `running`, `pid`, `stop()`."""

    def __init__(self, name: str, command: Sequence[str], env: Mapping[str, str], *, log_file: Path | None = None,
                 stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.name = name
        self._command = list(command)
        self._env = dict(env)
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
            self._process = subprocess.Popen(self._command, env=self._env, stdout=output,
                                             stderr=subprocess.STDOUT if output is not None else None)
        finally:
            if output is not None:
                output.close()
        log.info("%s started (pid %d)", self.name, self._process.pid)

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
                log.warning("%s did not stop within %.0f s; killing it", self.name, self._stop_timeout_s)
                process.kill()
                process.wait()
        elif process.returncode != 0:
            log.warning("%s had exited with code %d", self.name, process.returncode)
        return process.returncode
