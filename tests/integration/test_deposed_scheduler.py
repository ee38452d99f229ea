"""A deposed scheduler answers nothing it was fenced on, and the leader adopts what it left pending.

Found by the chaos rounds (tests/integration/test_chaos.py, `make chaos` seed 4): a Redis restart outlasted
a scheduler's lease, a standby took over (recovering the queue), and the old scheduler, which had not
noticed yet, still ran `load_adapter` requests. The replicas refused its calls (fenced: an older lease
generation), and it stored that refusal as the requests' results: two tenants got "internal error while
running the request: Fenced ..." instead of their models. Now a fenced item is not the deposed scheduler's
to answer (`services.runtime.dispatch`): it stores no result and acks nothing, and the leader's sweep
(`services.runtime.recovery.GuardedQueue`) adopts entries left pending for another consumer, so it runs
them itself — also those the deposed one claimed after the leader's recovery, which nobody ran before.

Real parts: a worker replica (`ReplicaHost` on a thread: engine, executor, Redis endpoint), and two
`SchedulerLoop`s driven one iteration at a time, each with its `ReplicaPool` (lease generations 1 and 2)
and its own consumer of the Redis work stream, over the real Redis result store and notifier (a scratch
prefix).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deploy.cluster_wiring import cluster_config
from deploy.settings import ClusterSettings
from services.domain.training import AdapterId, LoraSpec
from services.jobqueue import ResultStatus, StoredResult
from services.jobqueue.redis_queue import DEFAULT_GROUP, RedisWorkQueue
from services.jobqueue.redis_results import RedisNotifier, RedisResultStore
from services.runtime import SchedulerLoop
from services.runtime.commands import CreateAdapter
from services.runtime.journal import RedisJournal, RedisPlacement
from services.runtime.recovery import GuardedQueue
from services.runtime.redis_replicas import ClusterKeys, RedisReplicaLink, connect
from services.runtime.replica_pool import PoolConfig, ReplicaPool, TrackingHook
from services.runtime.replica_protocol import Fenced
from services.runtime.reporting import NullCompletionHook
from services.scheduler.requests import QueuedRequest, RequestKind
from tests.integration.cluster_support import BASE, RANK, REDIS_URL, cluster_settings, scratch_prefix, wait_until
from tests.required import require_redis
from worker.serve.replica import ReplicaHost

SWEEP_S = 0.3
"""The leader's lost-delivery sweep interval (production: 2 s); short, so the test does not wait long."""


@dataclass
class Scheduler:
    """One scheduler's loop and what the test inspects of it."""

    loop: SchedulerLoop
    queue: GuardedQueue
    results: RedisResultStore


@pytest.fixture
def settings(tmp_path: Path, tiny_model_dir: Path) -> Iterator[ClusterSettings]:
    require_redis()
    with scratch_prefix() as prefix:
        yield cluster_settings(tmp_path / "data", tiny_model_dir, "postgresql://unused/none", REDIS_URL, prefix)


def test_a_fenced_scheduler_answers_nothing_and_the_leader_runs_what_it_left(settings: ClusterSettings) -> None:
    config = cluster_config(settings)
    replica = ReplicaHost(config.spec(BASE), config, replica_id="only-replica")
    try:
        old = _scheduler(settings, "old", fence=1)
        _run_until_answered(old, _create("first", "model-a"))

        new = _scheduler(settings, "new", fence=2)  # takes over: recovers the queue (nothing pending) ...
        new.queue.recover(BASE)
        _run_until_answered(new, _create("second", "model-b"))  # ... and the replica now follows generation 2

        stale = _create("third", "model-c")
        old.queue.enqueue(BASE, stale)
        with pytest.raises(Fenced):  # the deposed scheduler claims it (it has not noticed) and is refused
            old.loop.run_once(wait_s=5.0)
        assert old.results.get_nowait(stale.request_id) is None, "a fenced scheduler stored an answer"
        assert _pending_for(settings, "old") == 1  # not acked: the entry is still there to adopt

        answer = _run_until_answered(new, None)
        assert answer.status is ResultStatus.OK, answer.value
        assert _pending_for(settings, "old") == 0 and _pending_for(settings, "new") == 0
        assert replica.engine.has_adapter(AdapterId("adapter-model-c"))
    finally:
        replica.stop()


def _scheduler(settings: ClusterSettings, consumer: str, *, fence: int) -> Scheduler:
    client, keys, prefix = connect(settings.redis_url), ClusterKeys(BASE, settings.redis_prefix), settings.redis_prefix
    link = RedisReplicaLink(client, keys, heartbeat_ttl_s=settings.heartbeat_ttl_seconds)
    pool = ReplicaPool(BASE, link, RedisPlacement(client, keys), RedisJournal(client, keys),
                       PoolConfig(snapshot_dir=settings.resolved_snapshot_dir.resolve(), replica_wait_s=30),
                       fence=lambda: fence)
    queue = GuardedQueue(RedisWorkQueue(client, prefix=prefix, consumer=consumer), client, check_every_s=SWEEP_S)
    results = RedisResultStore(client, prefix=prefix)
    loop = SchedulerLoop(BASE, pool, queue, results, RedisNotifier(client, prefix=prefix),
                         hook=TrackingHook(pool.context, NullCompletionHook()))
    return Scheduler(loop, queue, results)


def _create(request_id: str, model_id: str) -> QueuedRequest:
    payload = CreateAdapter(model_id, AdapterId(f"adapter-{model_id}"), LoraSpec(rank=RANK, seed=1))
    return QueuedRequest(request_id, "tenant", model_id, RequestKind.CREATE, 0, payload=payload)


def _run_until_answered(scheduler: Scheduler, request: QueuedRequest | None) -> StoredResult:
    """Enqueue `request` (None: the one the test left pending) and run the loop until its result is stored."""
    if request is not None:
        scheduler.queue.enqueue(BASE, request)
    request_id = request.request_id if request is not None else "third"
    answer: list[StoredResult] = []

    def answered() -> bool:
        scheduler.loop.run_once(wait_s=SWEEP_S)
        stored = scheduler.results.get_nowait(request_id)  # type: ignore[arg-type]
        if stored is not None:
            answer.append(stored)
        return bool(answer)

    wait_until(answered, 60, f"request {request_id} was never answered")
    return answer[0]


def _pending_for(settings: ClusterSettings, consumer: str) -> int:
    client = connect(settings.redis_url)
    stream = RedisWorkQueue(client, prefix=settings.redis_prefix, consumer=consumer).stream_key(BASE)
    return len(client.xpending_range(stream, DEFAULT_GROUP, "-", "+", 100, consumername=consumer))
