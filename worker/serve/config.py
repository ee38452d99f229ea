"""The cluster's worker configuration: which base models run how many replicas with what resources.

Read from a TOML file (`deploy/cluster.toml` is an example) or built by the composition root from
settings; either way `worker.serve.app` builds every Serve deployment from one `ClusterConfig`.

    [cluster]                      # optional; missing keys come from settings (CARPOOL_*)
    redis_url = "redis://127.0.0.1:6379/0"
    prefix = "carpool"
    heartbeat_ttl_seconds = 5.0
    data_dir = "/var/lib/carpool"  # model cache, spill and scratch space of the replicas (made absolute)

    [cluster.env]                  # environment of every replica (Ray runtime_env)
    HF_HUB_OFFLINE = "1"

    [[base_model]]
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    source = "smollm2-135m"
    replicas = 2
    num_cpus = 0.5
    num_gpus = 0                   # 1 (or a fraction) on GPU nodes
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class WorkerSpec:
    """One base model's deployment."""

    name: str
    """The public base-model name tenants ask for."""
    source: str
    """Where the weights come from (see `worker.models.sources`)."""
    replicas: int = 1
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    max_resident_adapters: int = 64
    max_tokens_per_pass: int = 8192
    micro_batch_tokens: int | None = None
    """Tokens per packed pass (see `EngineConfig.micro_batch_tokens`); None: the engine's choice for its device."""
    keep_freed_host_memory: bool = True
    """CPU replicas keep freed memory for reuse (see `EngineConfig.keep_freed_host_memory`)."""
    device: str | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class S3Settings:
    """`CARPOOL_STORAGE_URL=s3://...` and its knobs, as a replica needs them (see deploy/settings.py)."""

    url: str
    endpoint_url: str | None = None
    cache_dir: str | None = None
    """Default: <data_dir>/s3-cache."""
    cache_max_bytes: int = 10 << 30
    multipart_threshold: int = 64 << 20
    timeout_s: float = 30.0


@dataclass(frozen=True)
class ClusterConfig:
    """Everything a replica needs to find Redis and its model, plus the deployments to run."""

    redis_url: str
    prefix: str = "carpool"
    heartbeat_ttl_seconds: float = 5.0
    data_dir: str = "./data"
    cache_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    base_models: tuple[WorkerSpec, ...] = ()
    storage: S3Settings | None = None
    """Checkpoints on S3 (replicas upload saves and fetch loads through it); None: a shared local dir."""

    def spec(self, name: str) -> WorkerSpec:
        for spec in self.base_models:
            if spec.name == name:
                return spec
        raise KeyError(f"base model {name!r} is not in the cluster config")

    @property
    def models_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else Path(self.data_dir) / "models"


class ClusterConfigError(ValueError):
    """A cluster config that cannot be used; the message names the key."""


def load_cluster_config(path: Path, defaults: ClusterConfig) -> ClusterConfig:
    """Read a TOML cluster config; what it leaves out comes from `defaults`."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ClusterConfigError(f"cannot read cluster config {path}: {exc}") from exc
    return parse_cluster_config(raw, defaults)


def parse_cluster_config(raw: dict[str, Any], defaults: ClusterConfig) -> ClusterConfig:
    cluster = dict(raw.get("cluster", {}))
    env = {**defaults.env, **{str(k): str(v) for k, v in cluster.pop("env", {}).items()}}
    config = replace(defaults, **{**_known(ClusterConfig, cluster, "cluster"), "env": env})
    # Replicas do not share the driver's working directory: relative paths would point elsewhere there.
    config = replace(config, data_dir=str(Path(config.data_dir).resolve()),
                     cache_dir=None if config.cache_dir is None else str(Path(config.cache_dir).resolve()))
    models = raw.get("base_model", [])
    if models:
        config = replace(config, base_models=tuple(_worker_spec(m) for m in models))
    if not config.base_models:
        raise ClusterConfigError("the cluster config names no [[base_model]]")
    return config


def _worker_spec(raw: dict[str, Any]) -> WorkerSpec:
    if "name" not in raw or "source" not in raw:
        raise ClusterConfigError(f"[[base_model]] needs a name and a source, got {sorted(raw)}")
    spec = WorkerSpec(**_known(WorkerSpec, raw, "base_model"))
    if spec.replicas < 1 or spec.num_cpus < 0 or spec.num_gpus < 0:
        raise ClusterConfigError(f"base model {spec.name}: replicas >= 1 and non-negative resources")
    return spec


def _known(kind: type, raw: dict[str, Any], table: str) -> dict[str, Any]:
    allowed = {f.name for f in fields(kind)}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ClusterConfigError(f"[{table}] has unknown keys {unknown}; allowed: {sorted(allowed)}")
    return dict(raw)
