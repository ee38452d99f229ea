"""What starting the e2e server in cluster mode takes: `carpool cluster up` with its own stores.

Each cluster-mode server gets a scratch PostgreSQL database and its own Redis key prefix (on the box's
shared servers), its own local Ray, one worker replica, and the production gateway. The admin commands a
test runs through `Server.cli` reach the same database through `CARPOOL_DATABASE_URL` in the server's env.
Cleanups drop the database and the prefix once the server has stopped.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable

import redis

from services.db.schema import upgrade_to_head
from services.db.testing import scratch_postgres_database
from tests.required import require_postgres, require_redis

REDIS_URL = os.environ.get("CARPOOL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
STOP_TIMEOUT_S = 90.0
"""`cluster up` stops Serve and Ray on SIGINT; that takes longer than stopping the embedded server."""


def require_cluster_services() -> None:
    """Cluster mode needs PostgreSQL and Redis (tests/required.py: a skip locally, an error in CI); Ray is a
    dependency of the project, so its absence is an import error, never a skip."""
    require_postgres()
    require_redis(REDIS_URL)


def cluster_launch(port: int, base_model_spec: str) -> tuple[list[str], dict[str, str], list[Callable[[], None]]]:
    """(`carpool` arguments, extra environment, cleanups) of a cluster-mode server."""
    stack = contextlib.ExitStack()
    database_url = stack.enter_context(scratch_postgres_database(prefix="carpool_e2e"))
    upgrade_to_head(database_url)
    prefix = f"carpool-e2e-{uuid.uuid4().hex[:10]}"
    env = {
        "CARPOOL_DATABASE_URL": database_url, "CARPOOL_REDIS_URL": REDIS_URL, "CARPOOL_REDIS_PREFIX": prefix,
        "CARPOOL_REPLICAS": "1", "CARPOOL_RAY_NUM_CPUS": "2", "RAY_AUTH_MODE": "disabled",
        "CARPOOL_ALLOW_INSECURE_REDIS": "1",  # the test Redis has no password
        "CARPOOL_SECRET_KEY": "e2e-cluster-server-secret-key-0123456789",  # required in cluster mode
    }
    args = ["cluster", "up", "--port", str(port), "--base-model", base_model_spec]
    return args, env, [lambda: wipe_prefix(REDIS_URL, prefix), stack.close]


def wipe_prefix(url: str, prefix: str) -> None:
    """Delete every key under `prefix` (a test's private corner of a shared Redis)."""
    with contextlib.suppress(redis.RedisError):
        client = redis.Redis.from_url(url)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
