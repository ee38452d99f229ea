"""`SchedulerService`: the scheduler of one base model in cluster mode (`carpool scheduler --base-model NAME`).

    standby ─(lease acquired)─▶ SchedulerLoop(RedisWorkQueue → RecoveringScheduler → ReplicaPool) ─┐
       ▲                                                                                          │
       └──────────────────(lease lost: stop the loop, stand by again)────────────────────────────┘

Any number may run per base model; one holds the lease (`services.runtime.lease`) and the others wait to
take over. Taking over is the ordinary start: the loop re-queues every unacknowledged queue entry
(`WorkQueue.recover`), the scheduler resumes each model at its durable position, and the pool reads the
placement map and the journal from Redis. While active it publishes its counters for the gateways: after
every plan item (before its results are stored, so a client holding a result finds the pass counted)
and once a second.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict

import redis

from deploy.embedded import _scheduler as embedded_scheduler
from deploy.embedded import loop_config
from deploy.metrics_wiring import placement_replicas
from deploy.settings import ClusterSettings
from services.control.recording import DatabaseCompletionHook
from services.db import Database
from services.jobqueue.redis_queue import RedisWorkQueue
from services.jobqueue.redis_results import RedisNotifier, RedisResultStore
from services.metrics import ProcessMetrics
from services.runtime import SchedulerLoop
from services.runtime.journal import RedisJournal, RedisPlacement
from services.runtime.recovery import (
    DatabasePositions,
    GuardedQueue,
    RecoveringScheduler,
    RetryingHook,
    SchedulerLease,
)
from services.runtime.redis_replicas import ClusterKeys, RedisReplicaLink
from services.runtime.replica_pool import PoolConfig, ReplicaPool, TrackingHook
from services.runtime.reporting import CompletionHook, StoreResults
from services.scheduler.requests import Completion, QueuedRequest

log = logging.getLogger(__name__)

STATS_EVERY_S = 1.0
STATS_TTL_S = 30


class SchedulerService:
    """Stand by, lead while holding the lease, repeat until stopped. `run` blocks; `start` uses a thread."""

    def __init__(self, settings: ClusterSettings, base_model: str, client: redis.Redis, db: Database,
                 holder: str, metrics: ProcessMetrics | None = None) -> None:
        self.settings = settings
        self.base_model = base_model
        self.keys = ClusterKeys(base_model, settings.redis_prefix)
        self.holder = holder
        self.pool: ReplicaPool | None = None
        self.loop: SchedulerLoop | None = None
        self._client = client
        self._db = db
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread: threading.Thread | None = None
        self.lease = SchedulerLease(client, self.keys, holder, ttl_s=settings.scheduler_lease_seconds,
                                    on_lost=self._lost.set)
        # The process's series (shared when `cluster up` runs several schedulers and the gateway together).
        self.metrics = metrics or ProcessMetrics.create(per_tenant=settings.metrics_per_tenant)
        self.metrics.add_replicas(placement_replicas(base_model, self._placement))
        self._series = self.metrics.runtime.for_model(base_model)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"scheduler-service:{self.base_model}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        log.info("%s: scheduler %s standing by for the lease", self.base_model, self.holder)
        while self.lease.acquire(self._stop):
            self._lost.clear()
            self._series.lease(True)
            try:
                self._lead()
            finally:
                self._series.lease(False)
                self.lease.release()

    def _placement(self) -> dict[str, str] | None:
        pool = self.pool
        return pool.placement() if pool is not None and self.loop is not None else None

    def _lead(self) -> None:
        results = RedisResultStore(self._client, prefix=self.settings.redis_prefix)
        loop, pool = self._build(results)
        self.loop, self.pool = loop, pool
        loop.start()
        try:
            while not self._stop.is_set() and not self._lost.is_set():
                self._publish_stats()
                self._stop.wait(STATS_EVERY_S)
        finally:
            loop.stop()
            pool.close()
            results.close()

    def _build(self, results: RedisResultStore) -> tuple[SchedulerLoop, ReplicaPool]:
        settings, client, prefix = self.settings, self._client, self.settings.redis_prefix
        link = RedisReplicaLink(client, self.keys, heartbeat_ttl_s=settings.heartbeat_ttl_seconds)
        config = PoolConfig(snapshot_dir=settings.resolved_snapshot_dir.resolve(),
                            snapshot_every_steps=settings.snapshot_every_steps,
                            replica_wait_s=settings.replica_wait_seconds)
        pool = ReplicaPool(self.base_model, link, RedisPlacement(client, self.keys), RedisJournal(client, self.keys),
                           config, fence=self.lease.fence)
        positions = DatabasePositions(self._db, lambda request_id: results.get_nowait(request_id) is not None)
        limits = embedded_scheduler(settings).limits  # the same limits as the embedded scheduler's
        recording = RetryingHook(DatabaseCompletionHook(self._db))
        hook = TrackingHook(pool.context, _PublishingHook(recording, self._publish_stats))
        queue = GuardedQueue(RedisWorkQueue(client, prefix=prefix, consumer=self.holder), client)
        loop = SchedulerLoop(self.base_model, pool, queue, results, RedisNotifier(client, prefix=prefix),
                             scheduler=RecoveringScheduler(positions, limits), hook=hook,
                             config=loop_config(settings), metrics=self.metrics.runtime)
        return loop, pool

    def _publish_stats(self) -> None:
        loop = self.loop
        if loop is None:
            return
        try:
            self._client.set(self.keys.stats, json.dumps(asdict(loop.stats())), ex=STATS_TTL_S)
        except redis.RedisError as error:
            log.debug("%s: stats not published: %s", self.base_model, error)


class _PublishingHook:
    """A `CompletionHook` that publishes the loop's counters (which already count the item's pass) as an item
    finishes, before `inner` stores its results."""

    def __init__(self, inner: CompletionHook, publish: Callable[[], None]) -> None:
        self._inner = inner
        self._publish = publish

    def started(self, requests: Sequence[QueuedRequest], pass_id: str) -> None:
        self._inner.started(requests, pass_id)

    def finished(self, completions: Sequence[Completion], pass_id: str | None,
                 store: StoreResults) -> list[Completion]:
        self._publish()
        return self._inner.finished(completions, pass_id, store)
