"""The Ray Serve application builder KubeRay runs: one base model's worker replicas from a RayService.

A RayService's `serveConfigV2` names `deploy.serve_app:build_worker_app` as the import path of one
application per base model, with that model's deployment in `args` (helm/carpool/templates/rayservice.yaml):

    args: {base_model: NAME, source: SOURCE, replicas: N, num_gpus: G, num_cpus: C}

Everything else (Redis, key prefix, shared data dir, engine limits) comes from the Ray pods' `CARPOOL_*`
environment through `ClusterSettings`, exactly as `carpool worker` builds it, so a Kubernetes worker and a
`carpool cluster up` worker are configured by the same code (`deploy.cluster_wiring.cluster_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from deploy.cluster_wiring import cluster_config
from deploy.settings import ClusterSettings
from worker.serve.config import ClusterConfig, WorkerSpec

REQUIRED_ARGS = ("base_model", "source")


class WorkerArgsError(ValueError):
    """The application's `args` in serveConfigV2 do not describe a deployment; the message names the key."""


def worker_config(args: Mapping[str, Any], settings: ClusterSettings) -> ClusterConfig:
    """The cluster config of exactly the base model `args` names, with its replicas and resources."""
    missing = [key for key in REQUIRED_ARGS if not str(args.get(key, "")).strip()]
    if missing:
        raise WorkerArgsError(f"serveConfigV2 args need {', '.join(missing)} (got {sorted(args)})")
    name, source = str(args["base_model"]), str(args["source"])
    model_settings = settings.model_copy(update={"base_models": [f"{name}={source}"]})
    config = cluster_config(model_settings)
    spec: WorkerSpec = config.spec(name)
    spec = replace(spec, replicas=_number(args, "replicas", spec.replicas, int, minimum=1),
                   num_gpus=_number(args, "num_gpus", spec.num_gpus, float, minimum=0),
                   num_cpus=_number(args, "num_cpus", spec.num_cpus, float, minimum=0))
    return replace(config, base_models=(spec,))


def build_worker_app(args: dict[str, Any]) -> Any:
    """Serve's application builder: the `Application` of one base model's worker replicas."""
    from worker.serve.app import application_name, build_applications

    config = worker_config(args, ClusterSettings())
    return build_applications(config)[application_name(config.base_models[0].name)]


def _number(args: Mapping[str, Any], key: str, default: float, kind: type, *, minimum: float) -> Any:
    if key not in args:
        return default
    try:
        value = kind(args[key])
    except (TypeError, ValueError) as exc:
        raise WorkerArgsError(f"serveConfigV2 args: {key} must be a number, got {args[key]!r}") from exc
    if value < minimum:
        raise WorkerArgsError(f"serveConfigV2 args: {key} must be >= {minimum}, got {value}")
    return value
