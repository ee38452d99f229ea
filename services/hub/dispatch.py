"""Getting a queued push executed: Celery on the Redis broker (cluster), or threads of this process (serve).

Both run `PushRunner.run`, the one implementation of an attempt. Under Celery the task is `acks_late` with
`reject_on_worker_lost`: a worker killed mid-push leaves the message unacknowledged, Redis redelivers it
after the visibility timeout, and the runner resumes from the push row. Transient failures are retried by
`Task.retry(countdown=...)` with the runner's exponential backoff. `InProcessDispatcher` does the same
waiting with `time.sleep` on a small thread pool, so `carpool serve` needs no broker and no extra process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from services.hub.runner import PushRunner, RetryIn

log = logging.getLogger(__name__)

TASK_NAME = "carpool.hub_push"
CRASHED = "the push crashed on the server; see the hub worker's log"


class PushDispatcher(Protocol):
    def dispatch(self, push_id: int) -> None:
        """Have the push executed (soon, elsewhere); never blocks on the hub."""
        ...


class InProcessDispatcher:
    """Runs pushes on `workers` threads of this process, retrying transient failures after their backoff."""

    def __init__(self, runner: PushRunner, *, workers: int = 2,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._runner = runner
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hub-push")
        self._sleep = sleep

    def dispatch(self, push_id: int) -> None:
        self._pool.submit(self._run, push_id)

    def resume(self, push_ids: Iterable[int]) -> None:
        """Pushes a previous run of this process left unfinished (it was stopped mid-push)."""
        for push_id in push_ids:
            self.dispatch(push_id)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, push_id: int) -> None:
        attempt = 0
        try:
            while isinstance(outcome := self._runner.run(push_id, attempt), RetryIn):
                self._sleep(outcome.seconds)
                attempt += 1
        except Exception:  # noqa: BLE001 - a thread must not die silently: the push is marked failed
            log.exception("hub push %s crashed", push_id)
            self._runner.fail_exhausted(push_id, CRASHED)


def celery_app(broker_url: str, *, prefix: str = "carpool") -> Any:
    """A Celery app on `broker_url` whose keys and queue are namespaced by `prefix`."""
    from celery import Celery

    app = Celery("carpool-hub", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        task_ignore_result=True, task_default_queue=f"{prefix}.hub_pushes",
        broker_transport_options={"global_keyprefix": f"{prefix}:celery:", "visibility_timeout": 3600},
        broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
        task_serializer="json", accept_content=["json"],
        # A gateway must answer (503) soon when the broker is down, not hang in publish retries.
        broker_connection_timeout=5, task_publish_retry_policy={
            "max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1},
    )
    return app


def register_push_task(app: Any, runner: PushRunner) -> Any:
    """The push task on `app` (what `carpool hub-worker` executes)."""

    @app.task(name=TASK_NAME, bind=True, acks_late=True, max_retries=None)
    def hub_push(task: Any, push_id: int) -> str:
        try:
            outcome = runner.run(push_id, task.request.retries)
        except Exception:  # noqa: BLE001 - a bug must end the push, not leave it running forever
            log.exception("hub push %s crashed", push_id)
            runner.fail_exhausted(push_id, CRASHED)
            return "failed"
        if isinstance(outcome, RetryIn):
            raise task.retry(countdown=outcome.seconds)
        return outcome.status

    return hub_push


class CeleryDispatcher:
    """Sends pushes to `carpool hub-worker` processes through the broker (by task name: no task code here)."""

    def __init__(self, app: Any) -> None:
        self._app = app

    def dispatch(self, push_id: int) -> None:
        self._app.send_task(TASK_NAME, args=[push_id])
