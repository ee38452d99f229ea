"""Chaos in cluster mode: tenants train through the SDK while processes die at random points.

Each round builds a cluster (real PostgreSQL and Redis, a scratch database and key prefix): three worker
replicas on threads, the active scheduler as a `carpool scheduler` process, an in-process standby, the
cluster gateway over HTTP. `TENANTS` SDK tenants train (forward_backward + optim_step per step, a
`save_state` at the end). At points drawn from the round's seed (printed; rerun a round with
`CHAOS_SEED=N`), the driver

- SIGKILLs the active scheduler **and** stops the heartbeat of the replica holding the most adapters in
  the same instant (inside one snapshot interval: the double failure the journal's `applied` closes), and
- restarts the gateway (the SDK retries its connection errors against the new one on the same port).

After each round: every call of every tenant returned (`train_all` re-raises any failure), the standby
holds the lease, and every tenant's final weights equal those of the same steps run alone on an in-process
engine (≤ 1e-5: each acknowledged optim_step applied exactly once, nobody affected by the others' faults).
Redis and PostgreSQL restarts are exercised by tests/integration/test_cluster_restarts.py (private servers).

Size: `CHAOS_ROUNDS` rounds (default 1 in `make test`; `make chaos` runs 6), `CHAOS_TENANTS` tenants (4).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from services.db.testing import scratch_postgres_database
from services.runtime.journal import RedisPlacement
from services.runtime.redis_replicas import ClusterKeys, connect
from tests.e2e.server import CARPOOL
from tests.integration.cluster_support import (
    BASE,
    REDIS_URL,
    ClusterStack,
    assert_equal_to_reference,
    cluster_settings,
    create_tenant_keys,
    prepared_database,
    reference_weights,
    scratch_prefix,
    settings_env,
    train_all,
    wait_until,
)
from tests.required import require_postgres

ROUNDS = int(os.environ.get("CHAOS_ROUNDS", "1"))
TENANTS = int(os.environ.get("CHAOS_TENANTS", "4"))
STEPS = 5
SEEDS = [int(os.environ["CHAOS_SEED"])] if "CHAOS_SEED" in os.environ else list(range(1, ROUNDS + 1))


@pytest.mark.parametrize("seed", SEEDS)
def test_training_survives_random_kills_of_scheduler_replica_and_gateway(seed: int, tmp_path: Path,
                                                                          tiny_model_dir: Path) -> None:
    require_postgres()
    rng = random.Random(seed)
    total = TENANTS * STEPS
    kill_at = rng.randint(2, total // 2)
    gateway_at = rng.randint(kill_at + 1, total - 2)

    print(f"chaos seed {seed}: scheduler + replica die after step {kill_at}, gateway restarts after {gateway_at}")

    with scratch_postgres_database() as url, scratch_prefix() as prefix:
        settings = cluster_settings(tmp_path / "data", tiny_model_dir, prepared_database(url), REDIS_URL, prefix)
        stack = ClusterStack(settings)
        log = (tmp_path / "scheduler.log").open("wb")
        active = subprocess.Popen([CARPOOL, "scheduler", "--base-model", BASE],
                                  env={**os.environ, **settings_env(settings)}, stdout=log, stderr=subprocess.STDOUT)
        try:
            replicas = {r.replica_id: r for r in (stack.add_thread_replica() for _ in range(3))}
            client = connect(settings.redis_url)
            keys = ClusterKeys(BASE, settings.redis_prefix)
            wait_until(lambda: client.get(keys.lease) is not None, 240, "the scheduler process took no lease")
            standby = stack.start_standby()
            stack.start_gateway()
            tenant_keys = create_tenant_keys(settings.resolved_database_url(), TENANTS, prefix=f"chaos{seed}")
            done: list[int] = []
            lock = threading.Lock()
            killed: list[str] = []

            def chaos(_tenant: int, _step: int) -> None:
                with lock:
                    done.append(1)
                    count = len(done)
                if count == kill_at:
                    placement = RedisPlacement(client, keys).load()
                    victim = max(replicas, key=lambda r: sum(1 for v in placement.values() if v == r))
                    active.kill()  # the scheduler and the replica in the same instant
                    replicas[victim].stop(leave=False)
                    killed.append(victim)
                elif count == gateway_at:
                    stack.stop_gateway()
                    stack.start_gateway()

            paths = train_all(stack.url, tenant_keys, STEPS, chaos)
            assert active.wait(timeout=30) == -signal.SIGKILL
            assert killed and standby.lease.held
            assert standby.pool is not None and standby.pool.failovers >= 1
        finally:
            active.kill()
            log.close()
            stack.close()
        expected = reference_weights(tiny_model_dir, TENANTS, STEPS)
        assert_equal_to_reference(settings.resolved_database_url(), settings.data_dir, paths, expected, f"seed {seed} ")
