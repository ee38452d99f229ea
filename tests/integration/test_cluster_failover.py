"""Cluster mode without Ray: two worker replicas hosted on threads, the real scheduler service, the cluster
gateway over HTTP and six tenants training through the `tinker` SDK at once.

Shows the data plane's core promises on real PostgreSQL and Redis: adapters spread over both replicas,
passes carry several tenants, a replica that dies mid-training is replaced by restoring its adapters
from snapshot + request log on the survivor, every call completes, and every tenant's final weights equal
an uninterrupted run on an in-process engine. Also `carpool worker` as its own process: the Ray Serve
replicas of a real deployment, found through Redis by the scheduler (a replica's process killed with
SIGKILL is tests/integration/test_cluster_ray.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from services.control.recording import DatabaseCompletionHook
from services.db.database import open_database
from services.db.models import RequestRow
from services.db.request_log import UNFINISHED
from services.db.testing import scratch_postgres_database
from services.runtime.redis_replicas import ClusterKeys, RedisReplicaLink, connect
from tests.e2e.server import CARPOOL
from tests.integration.cluster_support import (
    BASE,
    REDIS_URL,
    ClusterStack,
    assert_equal_to_reference,
    cluster_settings,
    create_tenant_keys,
    max_difference,
    prepared_database,
    reference_weights,
    saved_weights,
    scratch_prefix,
    settings_env,
    train_all,
    wait_until,
)
from tests.required import require_postgres

TENANTS = 6
STEPS = 6


@pytest.fixture
def stack(tmp_path: Path, tiny_model_dir: Path) -> Iterator[ClusterStack]:
    require_postgres()
    with scratch_postgres_database() as url, scratch_prefix() as prefix:
        settings = cluster_settings(tmp_path / "data", tiny_model_dir, prepared_database(url), REDIS_URL, prefix)
        stack = ClusterStack(settings)
        try:
            yield stack
        finally:
            stack.close()


def test_a_replica_dies_mid_training_and_nothing_is_lost(stack: ClusterStack, tiny_model_dir: Path) -> None:
    first, second = stack.add_thread_replica(), stack.add_thread_replica()
    scheduler = stack.start_scheduler()
    stack.start_gateway()
    keys = create_tenant_keys(stack.settings.resolved_database_url(), TENANTS)
    crashed = threading.Event()
    placement_at_crash: dict[str, str] = {}
    done_steps: list[int] = []

    def crash_once(_tenant: int, _step: int) -> None:
        done_steps.append(1)
        if len(done_steps) >= 2 * TENANTS and not crashed.is_set():
            crashed.set()
            assert scheduler.pool is not None
            placement_at_crash.update(scheduler.pool.placement())
            first.stop(leave=False)  # no goodbye: its heartbeat just stops, as when the process dies

    paths = train_all(stack.url, keys, STEPS, crash_once)

    assert crashed.is_set()
    assert set(placement_at_crash.values()) == {first.replica_id, second.replica_id}
    pool = scheduler.pool
    assert pool is not None and pool.failovers >= 1 and pool.restores >= 1
    assert set(pool.placement().values()) == {second.replica_id}
    assert scheduler.loop is not None and scheduler.loop.stats().multi_tenant_passes > 0
    expected = reference_weights(tiny_model_dir, TENANTS, STEPS)
    assert_equal_to_reference(stack.settings.resolved_database_url(), stack.settings.data_dir, paths, expected)


def test_a_standby_scheduler_takes_over_from_a_killed_one(stack: ClusterStack, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """The active scheduler is a `carpool scheduler` process, SIGKILLed mid-training; an in-process standby
    takes the lease when it expires, re-queues what the dead one held, resumes every model at its durable
    position, and the replicas answer re-sent requests from memory: nothing is lost or applied twice."""
    stack.add_thread_replica()
    stack.add_thread_replica()
    active = subprocess.Popen([CARPOOL, "scheduler", "--base-model", BASE],
                              env={**os.environ, **settings_env(stack.settings)},
                              stdout=(tmp_path / "scheduler.log").open("wb"), stderr=subprocess.STDOUT)
    client = connect(stack.settings.redis_url)
    keys = ClusterKeys(BASE, stack.settings.redis_prefix)
    try:
        wait_until(lambda: client.get(keys.lease) is not None, 60, "the scheduler process took no lease")
        standby = stack.start_standby()
        stack.start_gateway()
        tenant_keys = create_tenant_keys(stack.settings.resolved_database_url(), 3, prefix="takeover")
        steps: list[int] = []

        def kill_active(_tenant: int, _step: int) -> None:
            steps.append(1)
            if len(steps) == 4:
                active.kill()

        paths = train_all(stack.url, tenant_keys, STEPS, kill_active)
        assert active.wait(timeout=10) == -signal.SIGKILL
        assert standby.lease.held
    finally:
        active.kill()
    expected = reference_weights(tiny_model_dir, 3, STEPS)
    assert_equal_to_reference(stack.settings.resolved_database_url(), stack.settings.data_dir, paths, expected)


@pytest.mark.parametrize("results_kept", ["expired", "stored"])
def test_a_successor_finishes_what_a_scheduler_could_not_record(tmp_path: Path, tiny_model_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                results_kept: str) -> None:
    """The scheduler's bookkeeping fails for good (as after a PostgreSQL outage longer than its retries) while
    tenants go on training: they get their results. Then the scheduler stops and a standby takes over.

    "expired": the answered results are gone (kept 0.5 s). Before, the dead scheduler had acknowledged those
    requests, so the standby waited at the first unrecorded one for a request no client would send again:
    every run stalled. Now their queue entries were held: the standby runs them again and the replica answers
    them from memory. "stored": the results are still there, so the standby skips those requests as
    finished; it records them from their stored results (before, their rows stayed unfinished for ever).
    Either way every tenant ends with the weights of an uninterrupted run and no request is left unfinished."""
    require_postgres()
    failing = threading.Event()
    real_finished = DatabaseCompletionHook.finished

    def finished(self: DatabaseCompletionHook, *args: Any, **kwargs: Any) -> Any:
        if failing.is_set():
            raise RuntimeError("request log unreachable (retries exhausted)")
        return real_finished(self, *args, **kwargs)

    monkeypatch.setattr(DatabaseCompletionHook, "finished", finished)
    with scratch_postgres_database() as url, scratch_prefix() as prefix:
        settings = cluster_settings(tmp_path / "data", tiny_model_dir, prepared_database(url), REDIS_URL, prefix,
                                    answered_result_seconds=0.5 if results_kept == "expired" else 120.0)
        stack = ClusterStack(settings)
        try:
            stack.add_thread_replica()
            first = stack.start_scheduler()
            stack.start_gateway()
            keys = create_tenant_keys(settings.resolved_database_url(), 3, prefix="unrecorded")
            steps: list[int] = []
            lock = threading.Lock()

            def fail_then_hand_over(_tenant: int, _step: int) -> None:
                with lock:
                    steps.append(1)
                    if len(steps) == 3:
                        failing.set()
                    elif len(steps) == 9:
                        assert first.loop is not None and first.loop.unrecorded > 0
                        first.stop()
                        if results_kept == "expired":
                            time.sleep(1.0)  # the answered results of the unrecorded requests expire
                        failing.clear()
                        stack.start_scheduler()

            paths = train_all(stack.url, keys, STEPS, fail_then_hand_over, wait_s=120.0)
            assert len(steps) == 3 * STEPS
        finally:
            stack.close()
            first.stop()
        expected = reference_weights(tiny_model_dir, 3, STEPS)
        assert_equal_to_reference(settings.resolved_database_url(), settings.data_dir, paths, expected)
        assert unfinished_requests(settings.resolved_database_url()) == 0


def unfinished_requests(database_url: str) -> int:
    db = open_database(database_url)
    try:
        with db.sessions.begin() as session:
            return int(session.scalar(select(func.count()).select_from(RequestRow)
                                      .where(RequestRow.status.in_(UNFINISHED))) or 0)
    finally:
        db.dispose()


def test_carpool_worker_serves_a_tenant_and_stops_on_sigint(stack: ClusterStack, tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    """`carpool worker` starts a local Ray and deploys the Serve replica; an in-process scheduler and gateway
    find it through Redis, a tenant trains to the reference weights, and SIGINT removes it with exit 0."""
    env = {**os.environ, **settings_env(stack.settings), "CARPOOL_REPLICAS": "1", "CARPOOL_RAY_NUM_CPUS": "2",
           "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)  # its own local Ray, not one a neighbouring test may have started
    log_path = tmp_path / "worker.log"
    worker = subprocess.Popen([CARPOOL, "worker"], env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    link = RedisReplicaLink(connect(stack.settings.redis_url), ClusterKeys(BASE, stack.settings.redis_prefix))
    try:
        wait_until(lambda: worker.poll() is not None or len(link.live_replicas()) == 1, 600,
                   "`carpool worker` registered no replica")
        assert worker.poll() is None, log_path.read_text(errors="replace")[-4000:]
        assert link.replica_infos()[0].pid != os.getpid()  # the replica lives in a Ray worker process
        stack.start_scheduler()
        stack.start_gateway()
        keys = create_tenant_keys(stack.settings.resolved_database_url(), 1, prefix="worker-cli")
        (path,) = train_all(stack.url, keys, 3)
        got = saved_weights(stack.settings.resolved_database_url(), stack.settings.data_dir, path)
        assert max_difference(got, reference_weights(tiny_model_dir, 1, 3)[0]) <= 1e-5
        worker.send_signal(signal.SIGINT)
        assert worker.wait(timeout=180) == 0, log_path.read_text(errors="replace")[-4000:]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)
