"""The gateway of cluster mode (`carpool serve --mode cluster`): the same app, shared state, no engine.

    ClusterSettings ─▶ PostgreSQL (checked at head) ─▶ admin bootstrapped (printed once)
                    ─▶ Redis queue / results / notifier (subscribed before serving)
                    ─▶ base models as the workers published them (waits until every one is there)
                    ─▶ ServiceControlPlane with Redis-shared sampler bindings and load attempts
                    ─▶ gateway.app.create_app ─▶ uvicorn

Several gateway processes may serve the same cluster: everything a request needs later lives in
PostgreSQL or Redis. Unlike the embedded server, start-up does not fail unfinished requests: they are
still queued, and the schedulers finish them.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import redis

from deploy.admin import bootstrap_admin
from deploy.cluster_wiring import cluster_config, connect_redis, open_cluster_database
from deploy.embedded import (
    EmbeddedService,
    StartupError,
    _checkpoint_store,
    _control_options,
    build_gateway_app,
    install_key_redaction,
    sweeper_thread,
)
from deploy.gc_tuning import tune_collector
from deploy.settings import ClusterSettings
from services.auth.invalidation import RedisAuthInvalidations
from services.control.api import RuntimeStats
from services.control.plane import ServiceControlPlane
from services.control.quota_store import RedisQuotaStore
from services.control.redis_state import RedisLoadLedger, RedisSamplerDirectory
from services.control.registry import ServedModel
from services.db.errors import ConflictError
from services.jobqueue.redis_queue import RedisWorkQueue
from services.jobqueue.redis_results import RedisNotifier, RedisResultStore
from services.metrics import ProcessMetrics
from services.runtime.redis_replicas import ClusterKeys
from services.runtime.replica_protocol import PublishedModel
from services.storage import load_or_create_secret

log = logging.getLogger(__name__)


@dataclass
class ClusterGateway:
    """A built gateway: the app to serve and what to close afterwards."""

    service: EmbeddedService
    app: Any
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for close in self.closers:
            close()
        self.service.stop()


def build_cluster_gateway(settings: ClusterSettings, *, out: TextIO | None = None,
                          metrics: ProcessMetrics | None = None) -> ClusterGateway:
    db = open_cluster_database(settings)
    try:
        bootstrap_admin(db, out or sys.stdout)
    except ConflictError:  # another gateway starting at the same moment created the admin tenant
        log.info("the admin tenant was created by another process")
    client = connect_redis(settings)
    prefix = settings.redis_prefix
    queue = RedisWorkQueue(client, prefix=prefix)
    results = RedisResultStore(client, prefix=prefix)
    notifier = RedisNotifier(client, prefix=prefix)
    if not notifier.start():
        log.warning("the result notifier is not subscribed yet; long-polls re-check once it is")
    served = [_served(settings, client, name, published)
              for name, published in wait_for_models(client, settings).items()]
    store = _checkpoint_store(settings)
    control = ServiceControlPlane(db, queue, results, notifier, store, served,
                                  _control_options(settings), samplers=RedisSamplerDirectory(client, prefix=prefix),
                                  loads=RedisLoadLedger(client, prefix=prefix),
                                  quota_store=RedisQuotaStore(client, prefix=prefix),
                                  token_secret=load_or_create_secret(settings.signing_secret_path))
    # The embedded service type bundles exactly what the app factory needs (database + control plane);
    # here it runs no scheduler loops and holds no engines.
    service = EmbeddedService(settings, db, control, metrics=metrics, sweeper=sweeper_thread(settings, db, store))
    invalidations = RedisAuthInvalidations(client, prefix=prefix)  # revocations reach every gateway's cache
    app = build_gateway_app(settings, service, auth_bus=invalidations)
    return ClusterGateway(service, app, [invalidations.close, notifier.close, results.close, client.close])


def wait_for_models(client: redis.Redis, settings: ClusterSettings) -> dict[str, PublishedModel]:
    """Each served base model as its workers published it; waits (the gateway is not up before that)."""
    names = [spec.name for spec in cluster_config(settings).base_models]
    deadline = time.monotonic() + settings.model_info_wait_seconds
    found: dict[str, PublishedModel] = {}
    last_report = 0.0
    while True:
        for name in names:
            raw = None if name in found else client.get(ClusterKeys(name, settings.redis_prefix).model_info)
            if raw is not None:
                found[name] = PublishedModel.from_json(raw)
        missing = [n for n in names if n not in found]
        if not missing:
            return found
        if time.monotonic() > deadline:
            waited = settings.model_info_wait_seconds
            raise StartupError(f"no worker published {', '.join(missing)} within {waited:.0f} s\n"
                               "Fix: start the workers (`carpool worker`) for these base models.")
        if time.monotonic() - last_report > 10:
            log.info("waiting for workers of %s to publish their models ...", ", ".join(missing))
            last_report = time.monotonic()
        time.sleep(0.2)


def _served(settings: ClusterSettings, client: redis.Redis, name: str, published: PublishedModel) -> ServedModel:
    return ServedModel(published.info, published.limits, queue=name,
                       max_tokens_per_request=settings.max_tokens_per_step, max_lora_rank=settings.max_lora_rank,
                       stats=_stats_reader(client, ClusterKeys(name, settings.redis_prefix)))


def _stats_reader(client: redis.Redis, keys: ClusterKeys) -> Callable[[], RuntimeStats]:
    """The active scheduler's counters as it last published them (not running if none did lately)."""

    def read() -> RuntimeStats:
        try:
            raw = client.get(keys.stats)
        except redis.RedisError:
            raw = None
        if raw is None:
            return RuntimeStats(base_model=keys.base_model, running=False)
        return RuntimeStats(**json.loads(raw))

    return read


def serve_cluster_gateway(settings: ClusterSettings) -> None:
    """Build and serve until interrupted."""
    import uvicorn

    install_key_redaction()
    logging.getLogger().setLevel(settings.log_level.upper())
    gateway = build_cluster_gateway(settings)
    gateway.service.start()  # no scheduler loops here: the sweeper
    tune_collector()  # after everything startup builds: deploy/gc_tuning.py
    try:
        log.info("cluster gateway serving on http://%s:%d", settings.host, settings.port)
        uvicorn.run(gateway.app, host=settings.host, port=settings.port, log_config=None,
                    access_log=settings.access_log,
                    timeout_keep_alive=settings.http_keep_alive_seconds)
    finally:
        gateway.close()
