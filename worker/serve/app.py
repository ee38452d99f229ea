"""The Ray Serve side of cluster mode: one deployment per base model, built from one `ClusterConfig`.

    ClusterConfig ─▶ build_applications() ─▶ {app name: Serve application of `WorkerDeployment`}
                                               num_replicas, num_cpus / num_gpus per replica
    deploy_workers() ─▶ serve.run(...) per base model (no HTTP route: replicas pull work from Redis)

Serve gives hosting, replica counts, resources, health checks (`check_health` fails once a replica's
heartbeat or inbox thread died) and restarts; routing does not go through Serve at all, because a
scheduler must address the very replica that holds an adapter (see `services.runtime.redis_replicas`).
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Any

from ray import serve
from ray.serve.config import ProxyLocation
from ray.serve.deployment import Application

from worker.serve.config import ClusterConfig, WorkerSpec

log = logging.getLogger(__name__)

HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0


class WorkerDeployment:
    """The body of every worker replica: a `ReplicaHost` (imported here so the driver needs no torch)."""

    def __init__(self, spec: WorkerSpec, config: ClusterConfig) -> None:
        from worker.serve.replica import ReplicaHost

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._host = ReplicaHost(spec, config)

    def check_health(self) -> None:
        if not self._host.healthy:
            raise RuntimeError(f"replica {self._host.replica_id} stopped serving its inbox")

    async def __call__(self, *_: Any) -> dict[str, Any]:
        """Who this replica is (Serve needs a callable ingress; work never arrives this way)."""
        return {"replica_id": self._host.replica_id, "base_model": self._host.spec.name}

    def __del__(self) -> None:  # Serve's graceful shutdown: leave the membership at once
        host = getattr(self, "_host", None)
        if host is not None:
            host.stop()


def application_name(base_model: str) -> str:
    return f"carpool-worker-{serve_name(base_model)}"


def serve_name(base_model: str) -> str:
    """A Serve-safe name: Serve puts deployment names into %-style log formats, so no `%` (nor `/`) may
    appear; the hash keeps two models that differ only in such characters apart."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", base_model).strip("-")
    return f"{readable}-{hashlib.sha1(base_model.encode()).hexdigest()[:6]}"


def build_applications(config: ClusterConfig) -> dict[str, Application]:
    """One Serve application per base model of `config`."""
    return {application_name(spec.name): _deployment(spec, config).bind(spec, config)
            for spec in config.base_models}


def deploy_workers(config: ClusterConfig) -> list[str]:
    """Run every worker deployment on the connected Ray cluster (no HTTP proxies); returns the app names."""
    serve.start(proxy_location=ProxyLocation.Disabled)
    names = []
    for name, app in build_applications(config).items():
        serve.run(app, name=name, route_prefix=None, blocking=False)
        log.info("worker application %s is running", name)
        names.append(name)
    return names


def remove_workers(config: ClusterConfig) -> None:
    for spec in config.base_models:
        serve.delete(application_name(spec.name))


def _deployment(spec: WorkerSpec, config: ClusterConfig) -> Any:
    actor_options: dict[str, Any] = {"num_cpus": spec.num_cpus}
    if spec.num_gpus:
        actor_options["num_gpus"] = spec.num_gpus
    if config.env:
        actor_options["runtime_env"] = {"env_vars": dict(config.env)}
    return serve.deployment(
        WorkerDeployment,
        name=f"worker-{serve_name(spec.name)}",
        num_replicas=spec.replicas,
        ray_actor_options=actor_options,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=10,
    )
