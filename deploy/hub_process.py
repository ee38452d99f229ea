"""The hub worker that `carpool cluster up` runs beside its gateway: one `carpool hub-worker` child process.

Cluster gateways only queue hub pushes (Celery on the Redis broker); without a consumer they would stay
`queued` forever. `cluster up` is the whole cluster on one box, so it starts one hub worker with its own
settings and stops it on shutdown. It is a separate process, not a thread, because a Celery worker owns
its process (signal handlers, its own pool) and must not share the gateway's event loop.

The child is a `deploy.child_process.ChildProcess`: this process's environment plus what `cluster up`
decided itself, without the gateway's metrics port. Stopping sends SIGTERM (Celery's warm shutdown: a
running push may finish) and kills after `stop_timeout_s`; `acks_late` redelivers a push cut short that way.
"""

from __future__ import annotations

from pathlib import Path

from deploy.child_process import STOP_TIMEOUT_S, ChildProcess, carpool_command, child_env
from deploy.settings import ClusterSettings


def hub_worker_command(concurrency: int = 2) -> list[str]:
    """`carpool hub-worker` through this interpreter (works without the console script on PATH)."""
    return carpool_command("hub-worker", "--concurrency", str(concurrency))


def hub_worker_process(settings: ClusterSettings, *, concurrency: int = 2, log_file: Path | None = None,
                       stop_timeout_s: float = STOP_TIMEOUT_S) -> ChildProcess:
    """The `carpool hub-worker` child of `cluster up` (not started yet)."""
    return ChildProcess("hub worker", hub_worker_command(concurrency), child_env(settings), log_file=log_file,
                        stop_timeout_s=stop_timeout_s)
