"""`carpool cluster up` and `carpool worker`: a whole cluster on one box, and workers for containers.

    cluster up ─▶ PostgreSQL database (CARPOOL_DATABASE_URL, or `carpool` on the local server, created
                  and migrated) ─▶ local Ray ─▶ Serve worker deployments ─▶ one SchedulerService per base
                  model (a thread, or with CARPOOL_SCHEDULER_PROCESSES a `carpool scheduler` child
                  process) ─▶ cluster gateway on --port ─▶ one `carpool hub-worker` child process (hub
                  pushes) ─▶ until SIGINT/SIGTERM, then everything stops

Every part is the production one (the same processes `carpool worker`, `carpool scheduler` and `carpool
serve --mode cluster` run separately). By default the schedulers share the gateway's process, so the
gateway's /metrics shows all their series; with `scheduler_processes` each has a process (and a GIL) of its
own, as in production, which is what lets one box serve hundreds of clients (docs/reliability.md), and
only their pass counters reach the gateway's /metrics (through Redis, published by the scheduler).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from deploy.child_process import ChildProcess, carpool_command, child_env
from deploy.cluster_gateway import build_cluster_gateway
from deploy.cluster_wiring import cluster_config, connect_redis, open_cluster_database, process_name
from deploy.embedded import StartupError, install_key_redaction
from deploy.hub_process import hub_worker_process
from deploy.scheduler_service import SchedulerService
from deploy.settings import ClusterSettings
from services.db.engine import normalize_database_url
from services.db.schema import upgrade_to_head
from services.metrics import ProcessMetrics, start_metrics_server
from worker.serve.config import ClusterConfig

log = logging.getLogger(__name__)

LOCAL_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/carpool"


def ensure_database(settings: ClusterSettings) -> ClusterSettings:
    """Settings pointing at a migrated PostgreSQL database (created on the local server if unset)."""
    url = settings.database_url
    if not url:
        url = LOCAL_DATABASE_URL
        _create_database_if_missing(url)
        log.info("using %s; point the admin commands at it: export CARPOOL_DATABASE_URL=%s", url, url)
    url = normalize_database_url(url)
    upgrade_to_head(url)
    return settings.model_copy(update={"database_url": url})


def _create_database_if_missing(url: str) -> None:
    target = make_url(url)
    admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as connection:
            exists = connection.execute(text("SELECT 1 FROM pg_database WHERE datname = :name"),
                                        {"name": target.database}).first()
            if not exists:
                connection.execute(text(f'CREATE DATABASE "{target.database}"'))
    except Exception as exc:  # noqa: BLE001 - any failure here means the same thing to the operator
        raise StartupError(f"cannot create the database at {target.render_as_string(hide_password=True)}: {exc}\n"
                           "Fix: start PostgreSQL or set CARPOOL_DATABASE_URL.") from exc
    finally:
        admin.dispose()


def start_ray(settings: ClusterSettings, config: ClusterConfig) -> None:
    """Join `ray_address`, or start a local Ray sized for this box."""
    import ray

    from worker.serve.app import deploy_workers

    if settings.ray_address:
        ray.init(address=settings.ray_address)
    else:
        ray.init(num_cpus=settings.ray_num_cpus or os.cpu_count() or 1, include_dashboard=False)
    deploy_workers(config)


def stop_ray(settings: ClusterSettings, config: ClusterConfig) -> None:
    """Remove our workers (a joined cluster keeps its other Serve apps) and leave Ray."""
    import ray
    from ray import serve

    from worker.serve.app import remove_workers

    try:
        if settings.ray_address:
            remove_workers(config)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()


def cluster_up(settings: ClusterSettings) -> None:
    """Run everything until interrupted."""
    import uvicorn

    install_key_redaction()
    logging.getLogger().setLevel(settings.log_level.upper())
    settings = ensure_database(settings)
    config = cluster_config(settings)
    start_ray(settings, config)
    schedulers: list[SchedulerService | ChildProcess] = []
    gateway: Any = None
    hub_worker = hub_worker_process(settings)
    try:
        client, db = connect_redis(settings), open_cluster_database(settings)
        # One registry for the process: the gateway's /metrics shows its scheduler threads' series too.
        metrics = ProcessMetrics.create(per_tenant=settings.metrics_per_tenant)
        if settings.scheduler_processes:
            schedulers.extend(scheduler_children(settings, config))
        else:
            schedulers.extend(SchedulerService(settings, spec.name, client, db, process_name("scheduler"), metrics)
                              for spec in config.base_models)
        for scheduler in schedulers:
            scheduler.start()
        gateway = build_cluster_gateway(settings, metrics=metrics)
        gateway.service.start()  # the sweeper (the gateway runs no scheduler loops)
        hub_worker.start()  # consumes the hub pushes the gateway queues (after the secret key was checked)
        log.info("cluster serving %s on http://%s:%d", ", ".join(s.name for s in config.base_models),
                 settings.host, settings.port)
        uvicorn.run(gateway.app, host=settings.host, port=settings.port, log_config=None,
                    access_log=settings.access_log,
                    timeout_keep_alive=settings.http_keep_alive_seconds)
    finally:
        hub_worker.stop()
        for scheduler in schedulers:
            scheduler.stop()
        if gateway is not None:
            gateway.close()
        stop_ray(settings, config)


def scheduler_children(settings: ClusterSettings, config: ClusterConfig) -> list[ChildProcess]:
    """One `carpool scheduler --base-model NAME` child per base model, with `cluster up`'s settings; the
    i-th serves /metrics on `scheduler_metrics_port` + i when that is set."""
    children = []
    for index, spec in enumerate(config.base_models):
        env = child_env(settings)
        if settings.scheduler_metrics_port is not None:
            env["CARPOOL_METRICS_PORT"] = str(settings.scheduler_metrics_port + index)
        children.append(ChildProcess(f"scheduler of {spec.name}", carpool_command("scheduler", "--base-model",
                                                                                 spec.name), env))
    return children


def run_workers(settings: ClusterSettings) -> None:
    """Deploy the worker applications and keep them until SIGINT/SIGTERM (the container's lifetime)."""
    install_key_redaction()
    config = cluster_config(settings)
    # Handlers first: a signal that lands while Serve is still deploying must stop cleanly (exit 0), not
    # raise KeyboardInterrupt out of start_ray.
    stop = threading.Event()
    _stop_on_signals(stop)
    try:
        start_ray(settings, config)
        _stop_on_signals(stop)  # again: Ray may install its own handlers while it starts
        log.info("workers of %s deployed; stop with SIGTERM", ", ".join(s.name for s in config.base_models))
        stop.wait()
    except KeyboardInterrupt:
        log.info("interrupted while deploying; stopping")
    finally:
        stop_ray(settings, config)


def _stop_on_signals(stop: threading.Event) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())


def run_scheduler(settings: ClusterSettings, base_model: str) -> None:
    """One base model's scheduler service (active or standby) until SIGINT/SIGTERM."""
    install_key_redaction()
    names = [spec.name for spec in cluster_config(settings).base_models]
    if base_model not in names:
        raise StartupError(f"base model {base_model!r} is not configured; configured: {', '.join(names)}")
    service = SchedulerService(settings, base_model, connect_redis(settings), open_cluster_database(settings),
                               process_name("scheduler"))
    port = settings.metrics_port
    server = None if port is None else start_metrics_server(service.metrics.registry, host=settings.host, port=port)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    service.start()
    stop.wait()
    service.stop()
    if server is not None:
        server.close()
