"""What every cluster process builds alike from `ClusterSettings`: its worker config, Redis and database.

The gateway, the schedulers and the workers must agree on the Redis prefix, the base models and the
shared storage; deriving all of it here, from one settings object, is what keeps them agreeing.
"""

from __future__ import annotations

import os
import socket
import uuid
from urllib.parse import urlsplit, urlunsplit

import redis
from sqlalchemy.exc import OperationalError

from deploy.embedded import StartupError
from deploy.settings import ClusterSettings
from services.db import Database, open_database
from services.db.engine import is_sqlite
from services.db.schema import SchemaVersionError
from services.runtime.redis_replicas import connect
from worker.serve.config import ClusterConfig, ClusterConfigError, S3Settings, WorkerSpec, load_cluster_config

OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
"""Passed on to replicas when set here: a replica must not hang on a hub lookup the operator disabled."""


def cluster_config(settings: ClusterSettings) -> ClusterConfig:
    """The worker deployments: the TOML file if configured, else one per served base model."""
    specs = tuple(
        WorkerSpec(name=spec.name, source=spec.source, replicas=settings.replicas, num_cpus=settings.replica_num_cpus,
                   num_gpus=settings.replica_num_gpus, max_resident_adapters=settings.max_resident_adapters,
                   max_tokens_per_pass=settings.max_tokens_per_pass, micro_batch_tokens=settings.micro_batch_tokens,
                   device=settings.device, dtype=settings.dtype,
                   keep_freed_host_memory=settings.keep_freed_host_memory)
        for spec in settings.served_base_models()
    )
    defaults = ClusterConfig(
        redis_url=settings.redis_url, prefix=settings.redis_prefix,
        heartbeat_ttl_seconds=settings.heartbeat_ttl_seconds, data_dir=str(settings.data_dir.resolve()),
        cache_dir=str(settings.models_dir.resolve()), base_models=specs,
        env={name: os.environ[name] for name in OFFLINE_ENV if name in os.environ},
        storage=s3_settings(settings),
    )
    if settings.cluster_config is None:
        return defaults
    try:
        return load_cluster_config(settings.cluster_config, defaults)
    except ClusterConfigError as exc:
        raise StartupError(str(exc)) from exc


def s3_settings(settings: ClusterSettings) -> S3Settings | None:
    """What replicas need of `CARPOOL_STORAGE_URL` (None: checkpoints on the shared data dir)."""
    if not settings.storage_url:
        return None
    return S3Settings(url=settings.storage_url, endpoint_url=settings.s3_endpoint_url,
                      cache_dir=str(settings.s3_cache_dir) if settings.s3_cache_dir else None,
                      cache_max_bytes=settings.s3_cache_max_bytes,
                      multipart_threshold=settings.s3_multipart_threshold_bytes, timeout_s=settings.s3_timeout_seconds)


def connect_redis(settings: ClusterSettings) -> redis.Redis:
    """The cluster's Redis client. Refuses a Redis without a password or TLS unless explicitly allowed:
    whoever can write to it controls the queue, the results and the workers."""
    check_redis_trust(settings.redis_url, allow_insecure=settings.allow_insecure_redis)
    client = connect(settings.redis_url)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise StartupError(f"Redis unreachable at {redacted_url(settings.redis_url)}: {redacted(exc, settings)}\n"
                           "Fix: start Redis (with AOF) or set CARPOOL_REDIS_URL.") from exc
    return client


def check_redis_trust(url: str, *, allow_insecure: bool) -> None:
    """`StartupError` for a Redis URL with neither a password nor TLS, unless `allow_insecure`."""
    parts = urlsplit(url)
    if allow_insecure or parts.scheme == "rediss" or parts.password:
        return
    raise StartupError(f"Redis at {redacted_url(url)} needs neither a password nor TLS; in cluster mode anyone "
                       "who reaches it controls the queue and the workers.\nFix: set a password "
                       "(redis://:PASSWORD@host:6379/0, or requirepass / ACLs) or use rediss://; for local "
                       "development only, set CARPOOL_ALLOW_INSECURE_REDIS=1.")


def redacted_url(url: str) -> str:
    """`url` with its password replaced by `***` (for messages and logs)."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def redacted(exc: Exception, settings: ClusterSettings) -> str:
    """An exception's text without the Redis password (client errors may quote the URL)."""
    text = str(exc)
    password = urlsplit(settings.redis_url).password
    return text.replace(password, "***") if password else text


def open_cluster_database(settings: ClusterSettings) -> Database:
    """The shared PostgreSQL database, which must already be at the current schema (`carpool migrate`)."""
    url = settings.resolved_database_url()
    if is_sqlite(url):
        raise StartupError("cluster mode needs PostgreSQL shared by every process: set CARPOOL_DATABASE_URL "
                           "(e.g. postgresql://carpool@db:5432/carpool) and run `carpool migrate` once")
    try:
        return open_database(url, migrate=False, pool_size=settings.database_pool_size)
    except SchemaVersionError as exc:
        raise StartupError(f"{exc}\nFix: run `carpool migrate` against this database first.") from exc
    except OperationalError as exc:
        raise StartupError(f"database unreachable: {exc.orig}\n"
                           "Fix: start PostgreSQL or set CARPOOL_DATABASE_URL.") from exc


def process_name(role: str) -> str:
    """A unique, readable name for this process in leases and consumer groups."""
    return f"{role}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
