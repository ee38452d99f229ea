"""Cluster mode on Ray Serve: two worker replicas of one base model, six tenants training through the SDK.

One Ray instance for the module. Mid-training one replica's process is killed (SIGKILL: no goodbye, its
heartbeat just stops) and later the gateway process is killed and restarted while requests are queued.
Every client call completes, Serve replaces the dead replica, and each tenant's final weights equal an
uninterrupted run on an in-process engine (≤ 1e-5).
"""

from __future__ import annotations

import gc
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray import serve

from deploy.cluster_wiring import cluster_config
from services.db.testing import scratch_postgres_database
from services.runtime.redis_replicas import ClusterKeys, RedisReplicaLink, connect
from tests.integration.cluster_support import (
    BASE,
    REDIS_URL,
    ClusterStack,
    GatewayProcess,
    assert_equal_to_reference,
    cluster_settings,
    create_tenant_keys,
    prepared_database,
    reference_weights,
    scratch_prefix,
    train_all,
    wait_until,
)
from tests.required import require_postgres

TENANTS = 6
STEPS = 6


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        yield
    finally:
        # Handles and object refs left in reference cycles must die while Ray is up: one collected after
        # `ray.shutdown()` (in whatever thread the collector runs) makes Ray end the whole test process.
        gc.collect()
        serve.shutdown()
        gc.collect()
        ray.shutdown()


def test_killed_replica_and_restarted_gateway_lose_nothing(ray_instance: None, tmp_path: Path,
                                                           tiny_model_dir: Path) -> None:
    from worker.serve.app import deploy_workers, remove_workers

    require_postgres()
    with scratch_postgres_database() as url, scratch_prefix() as prefix:
        settings = cluster_settings(tmp_path / "data", tiny_model_dir, prepared_database(url), REDIS_URL, prefix,
                                    replicas=2, replica_num_cpus=0.5)
        config = cluster_config(settings)
        deploy_workers(config)
        stack = ClusterStack(settings)
        gateway = GatewayProcess(settings, stack.port, tmp_path / "gateway.log")
        link = RedisReplicaLink(connect(REDIS_URL), ClusterKeys(BASE, prefix))
        try:
            assert len(link.live_replicas()) == 2
            scheduler = stack.start_scheduler()
            gateway.start()
            paths = _train_with_faults(stack, gateway, link, settings.resolved_database_url())
            pool = scheduler.pool
            assert pool is not None and pool.failovers >= 1 and pool.restores >= 1
            assert scheduler.loop is not None and scheduler.loop.stats().multi_tenant_passes > 0
            wait_until(lambda: len(link.live_replicas()) == 2, 60, "Serve did not replace the killed replica")
            expected = reference_weights(tiny_model_dir, TENANTS, STEPS)
            assert_equal_to_reference(settings.resolved_database_url(), settings.data_dir, paths, expected)
        finally:
            gateway.kill()
            stack.close()
            remove_workers(config)


def _train_with_faults(stack: ClusterStack, gateway: GatewayProcess, link: RedisReplicaLink,
                       database_url: str) -> list[str]:
    """Six tenants train; after a third of the steps a replica is killed, after two thirds the gateway."""
    keys = create_tenant_keys(database_url, TENANTS)
    steps_done: list[int] = []
    lock = threading.Lock()
    spread: dict[str, str] = {}

    def faults(_tenant: int, _step: int) -> None:
        with lock:
            steps_done.append(1)
            done = len(steps_done)
        if done == 2 * TENANTS:
            assert stack.scheduler is not None and stack.scheduler.pool is not None
            spread.update(stack.scheduler.pool.placement())
            os.kill(link.replica_infos()[0].pid, signal.SIGKILL)
        elif done == 4 * TENANTS:
            gateway.kill()  # clients keep polling (connection refused) while their requests stay queued
            gateway.start()

    paths = train_all(stack.url, keys, STEPS, faults)
    assert len(steps_done) == TENANTS * STEPS
    assert len(set(spread.values())) == 2, f"adapters were not spread over both replicas: {spread}"
    return paths
