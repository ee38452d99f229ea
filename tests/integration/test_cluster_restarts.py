"""Cluster mode rides out restarts of its stores: Redis (with AOF) and PostgreSQL, on private servers.

Each test runs the whole cluster (thread-hosted replicas, scheduler service, cluster gateway over HTTP)
against a throwaway server of its own, kills that server mid-training and starts it again a moment
later. No manual step follows: the clients' calls all complete and every tenant's final weights equal an
uninterrupted run. Redis runs with `appendonly yes` + `appendfsync always`, as production must (see
docs/cluster.md): acknowledged queue entries, results and the durability log survive the kill.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from services.db.testing import scratch_postgres_database
from tests.integration.cluster_support import (
    REDIS_URL,
    ClusterStack,
    PrivatePostgres,
    PrivateRedis,
    assert_equal_to_reference,
    cluster_settings,
    create_tenant_keys,
    postgres_bin_dir,
    prepared_database,
    reference_weights,
    scratch_prefix,
    train_all,
)
from tests.required import missing, require_postgres

TENANTS = 3
STEPS = 6


def _train_through(stack: ClusterStack, fault: Callable[[], None], model_dir: Path) -> None:
    """Train every tenant, run `fault` once a third of the steps are done, then check the weights."""
    stack.add_thread_replica()
    stack.add_thread_replica()
    stack.start_scheduler()
    stack.start_gateway()
    database_url = stack.settings.resolved_database_url()
    keys = create_tenant_keys(database_url, TENANTS)
    done: list[int] = []
    lock = threading.Lock()

    def after_step(_tenant: int, _step: int) -> None:
        with lock:
            done.append(1)
            if len(done) == 2 * TENANTS:
                fault()

    paths = train_all(stack.url, keys, STEPS, after_step)
    expected = reference_weights(model_dir, TENANTS, STEPS)
    assert_equal_to_reference(database_url, stack.settings.data_dir, paths, expected)


def test_redis_restart_loses_nothing_acknowledged(tmp_path: Path, tiny_model_dir: Path) -> None:
    require_postgres()
    redis_server = PrivateRedis(tmp_path / "redis")
    redis_server.start()
    with scratch_postgres_database() as url:
        settings = cluster_settings(tmp_path / "data", tiny_model_dir, prepared_database(url), redis_server.url,
                                    "carpool")
        stack = ClusterStack(settings)

        def restart_redis() -> None:
            redis_server.kill()  # SIGKILL: with fsync always, every acknowledged write is on disk
            time.sleep(1.0)
            redis_server.start()

        try:
            _train_through(stack, restart_redis, tiny_model_dir)
        finally:
            stack.close()
            redis_server.kill()


def test_postgres_restart_is_ridden_out(tmp_path: Path, tiny_model_dir: Path) -> None:
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        missing("PostgreSQL's initdb and pg_ctl", "neither `pg_config --bindir` nor /usr/lib/postgresql/*/bin "
                "has them", "install the PostgreSQL server package (apt-get install postgresql)")
    postgres = PrivatePostgres(bin_dir)
    try:
        postgres.init()
    except BaseException:  # the binaries are there, so a failure to start is a real error: report it
        postgres.remove()
        raise
    try:
        with scratch_postgres_database(postgres.url) as url, scratch_prefix() as prefix:
            settings = cluster_settings(tmp_path / "data", tiny_model_dir, prepared_database(url), REDIS_URL,
                                        prefix)
            stack = ClusterStack(settings)

            def restart_postgres() -> None:
                postgres.stop("immediate")  # a crash as far as clients can tell
                time.sleep(1.5)
                postgres.start()

            try:
                _train_through(stack, restart_postgres, tiny_model_dir)
            finally:
                stack.close()
    finally:
        postgres.remove()
