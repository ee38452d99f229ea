"""A liveness heartbeat file for the hub worker (`carpool hub-worker`), for Kubernetes' liveness probe.

`celery inspect ping` needs a free execution slot, so it times out while a long push holds the worker's
only slot (concurrency 1) and the probe would kill a healthy worker mid-push. Instead a worker bootstep
touches `CARPOOL_HUB_HEARTBEAT_FILE` from the worker's own timer every few seconds: the file stays fresh
while the worker runs, pushing or idle, and goes stale once the worker hangs or stops (the step removes
it on a clean stop). The chart's probe fails when the file is older than `hubWorker.heartbeatMaxAgeSeconds`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HEARTBEAT_EVERY_S = 10.0


def touch(path: Path) -> None:
    """Create or refresh `path` (its mtime is the heartbeat); a failure is logged, never raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError as error:
        log.warning("hub worker heartbeat %s not written: %s", path, error)


def heartbeat_step(path: Path, every_s: float = HEARTBEAT_EVERY_S) -> type:
    """A Celery worker bootstep class that keeps `path` fresh every `every_s` seconds while the worker runs."""
    from celery import bootsteps

    class HeartbeatFile(bootsteps.StartStopStep):
        requires = {"celery.worker.components:Timer"}

        def __init__(self, worker: Any, **kwargs: Any) -> None:
            super().__init__(worker, **kwargs)
            self._timer_ref: Any = None

        def start(self, worker: Any) -> None:
            touch(path)
            self._timer_ref = worker.timer.call_repeatedly(every_s, touch, (path,), priority=10)

        def stop(self, worker: Any) -> None:
            if self._timer_ref is not None:
                self._timer_ref.cancel()
            path.unlink(missing_ok=True)

        terminate = stop  # a cold shutdown terminates steps instead of stopping them

    return HeartbeatFile


def install_heartbeat(app: Any, path: Path | None, every_s: float = HEARTBEAT_EVERY_S) -> None:
    """Add the heartbeat step to the workers of Celery `app` (nothing without a path)."""
    if path is not None:
        app.steps["worker"].add(heartbeat_step(path, every_s))
