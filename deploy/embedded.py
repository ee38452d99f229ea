"""The embedded deployment: the whole service in one process (`carpool serve`).

    settings ─▶ logging (API keys redacted) ─▶ base models resolved ─▶ database migrated, admin bootstrapped
             ─▶ one Engine + SchedulerLoop per base model ─▶ in-process queue / results / notifier
             ─▶ local checkpoint store with a persistent signing secret ─▶ ServiceControlPlane
             ─▶ gateway.app.create_app(GatewaySettings, control, DatabaseAuthenticator) ─▶ uvicorn

This is the composition root: the only place that sees both `gateway` and `worker`. Production wiring
(Redis, Postgres, separate workers) reuses the same parts with other implementations.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from deploy.admin import bootstrap_admin
from deploy.gc_tuning import tune_collector
from deploy.metrics_wiring import engine_replicas
from deploy.options import StartupError
from deploy.settings import BaseModelSpec, ServiceSettings
from deploy.storage_wiring import checkpoint_store, staged_backend
from services.auth.log_redaction import install_key_redaction
from services.control.context import ControlOptions
from services.control.plane import ServiceControlPlane
from services.control.quotas import QuotaOptions
from services.control.recording import DatabaseCompletionHook
from services.control.registry import ServedModel
from services.control.sessions import heartbeat_write_interval
from services.control.sweeper import Sweeper, SweeperThread, SweepOptions
from services.db import Database, open_database
from services.db.request_log import fail_unfinished_requests
from services.jobqueue import InMemoryNotifier, InMemoryResultStore, InMemoryWorkQueue
from services.metrics import ProcessMetrics
from services.runtime import LoopConfig, SchedulerLoop
from services.scheduler import Scheduler, SchedulerLimits
from services.storage import CheckpointStore, load_or_create_secret, safe_component

log = logging.getLogger(__name__)

RESTART_ERROR = "the server restarted before this request finished; submit it again"


@dataclass
class EmbeddedService:
    """Everything `carpool serve` runs, built but not started."""

    settings: ServiceSettings
    db: Database
    control: ServiceControlPlane
    loops: list[SchedulerLoop] = field(default_factory=list)
    engines: dict[str, Any] = field(default_factory=dict)
    metrics: ProcessMetrics | None = None
    """The process's Prometheus registry, shared by the loops, the engines' residency and the gateway."""
    sweeper: SweeperThread | None = None
    """Deletes expired checkpoints and finishes stale sessions while the service runs."""

    def start(self) -> None:
        for loop in self.loops:
            loop.start()
        if self.sweeper is not None:
            self.sweeper.start()

    def stop(self) -> None:
        if self.sweeper is not None:
            self.sweeper.stop()
        for loop in self.loops:
            loop.stop()
        self.control.close()
        self.db.dispose()


def resolve_base_models(settings: ServiceSettings) -> list[tuple[BaseModelSpec, Path]]:
    """Each served base model's local directory (downloading or converting on first use)."""
    from worker.models.sources import ModelSourceError, resolve_model_source

    resolved = []
    for spec in settings.served_base_models():
        log.info("resolving base model %s from %s ...", spec.name, spec.source)
        started = time.perf_counter()
        try:
            path = resolve_model_source(spec.source, settings.models_dir)
        except ModelSourceError as exc:
            raise StartupError(
                f"base model {spec.name}: cannot resolve source {spec.source!r}: {exc}\n"
                f"Fix: pass --base-model {spec.name}=SOURCE with a local model directory, hf://org/name, "
                "gguf://file.gguf or a built-in alias (smollm2-135m), or set CARPOOL_BASE_MODELS."
            ) from exc
        log.info("base model %s ready at %s (%.1f s)", spec.name, path, time.perf_counter() - started)
        resolved.append((spec, path))
    return resolved


def build_embedded(settings: ServiceSettings, *, out: TextIO | None = None) -> EmbeddedService:
    """Build the service (models loaded, database ready); `start()` then runs its scheduler loops."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    models = resolve_base_models(settings)
    db = open_database(settings.resolved_database_url(), migrate=True, pool_size=settings.database_pool_size)
    with db.sessions.begin() as session:
        failed = fail_unfinished_requests(session, error=RESTART_ERROR, category="server")
    if failed:
        log.warning("marked %d requests left unfinished by the previous run as failed", failed)
    bootstrap_admin(db, out or sys.stdout)
    queue, results, notifier = InMemoryWorkQueue(), InMemoryResultStore(), InMemoryNotifier()
    engines: dict[str, Any] = {}
    loops: list[SchedulerLoop] = []
    served = []
    metrics = ProcessMetrics.create(per_tenant=settings.metrics_per_tenant)
    metrics.add_replicas(engine_replicas(engines))
    store = _checkpoint_store(settings)
    for spec, path in models:
        engine = _engine(settings, spec, path)
        loop = SchedulerLoop(spec.name, staged_backend(engine, store), queue, results, notifier,
                             scheduler=_scheduler(settings),
                             hook=DatabaseCompletionHook(db),
                             config=loop_config(settings), metrics=metrics.runtime)
        metrics.runtime.for_model(spec.name).lease(True)  # embedded: this process always schedules
        engines[spec.name] = engine
        loops.append(loop)
        served.append(ServedModel(engine.info, engine.limits, queue=spec.name,
                                  max_tokens_per_request=settings.max_tokens_per_step,
                                  max_lora_rank=settings.max_lora_rank, stats=loop.stats))
    control = ServiceControlPlane(db, queue, results, notifier, store, served,
                                  _control_options(settings),
                                  token_secret=load_or_create_secret(settings.signing_secret_path))
    return EmbeddedService(settings, db, control, loops, engines, metrics, sweeper_thread(settings, db, store))


def _engine(settings: ServiceSettings, spec: BaseModelSpec, path: Path) -> Any:
    from worker.engine.engine import Engine, EngineConfig

    config = EngineConfig(max_tokens_per_pass=settings.max_tokens_per_pass,
                          max_resident_adapters=settings.max_resident_adapters,
                          spill_dir=settings.spill_dir / safe_component(spec.name),
                          device=settings.device, dtype=settings.dtype,
                          micro_batch_tokens=settings.micro_batch_tokens,
                          keep_freed_host_memory=settings.keep_freed_host_memory)
    return Engine(path, name=spec.name, config=config)


def loop_config(settings: ServiceSettings) -> LoopConfig:
    """The scheduler loop's timing settings (shared with the cluster's scheduler service)."""
    return LoopConfig(batch_window_s=settings.batch_window_ms / 1000,
                      batch_window_lookback_s=1.0 if settings.batch_window_adaptive else None)


def _scheduler(settings: ServiceSettings) -> Scheduler:
    max_pass_s = settings.max_pass_ms / 1000 if settings.max_pass_ms is not None else None
    # A pass's adapters are pinned on the device while it runs, so a pass holding more of them than the
    # resident slots would grow the worker's banks past what the operator sized (and never shrink them).
    adapters = min(settings.max_adapters_per_pass, settings.max_resident_adapters)
    return Scheduler(SchedulerLimits(max_tokens_per_pass=settings.max_tokens_per_step,
                                     max_adapters_per_pass=adapters,
                                     max_pass_seconds=max_pass_s,
                                     pass_latency_factor=settings.pass_latency_factor,
                                     hold_factor=settings.hold_factor,
                                     max_hold_seconds=settings.max_hold_ms / 1000))


def _checkpoint_store(settings: ServiceSettings) -> CheckpointStore:
    return checkpoint_store(settings)


def _control_options(settings: ServiceSettings) -> ControlOptions:
    return ControlOptions(long_poll_max_s=settings.long_poll_seconds,
                          answered_result_s=settings.answered_result_seconds,
                          heartbeat_write_s=heartbeat_write_interval(settings.stale_session_seconds),
                          download_url_ttl_s=float(settings.download_url_ttl_seconds),
                          default_max_models=settings.default_max_models_per_tenant,
                          scratch_dir=settings.scratch_dir, quotas=_quota_options(settings),
                          group_commit=settings.group_commit)


def _quota_options(settings: ServiceSettings) -> QuotaOptions:
    return QuotaOptions(default_tokens_per_minute=settings.default_tokens_per_minute,
                        default_max_concurrent_requests=settings.default_max_concurrent_requests,
                        token_window_s=settings.quota_window_seconds,
                        saturation_queue_depth=settings.saturation_queue_depth,
                        saturation_wait_s=settings.saturation_wait_seconds,
                        default_max_checkpoints=settings.default_max_checkpoints,
                        default_max_checkpoint_bytes=settings.default_max_checkpoint_bytes,
                        default_max_sessions=settings.default_max_sessions,
                        default_max_sampling_sessions=settings.default_max_sampling_sessions)


def sweeper_thread(settings: ServiceSettings, db: Database, store: CheckpointStore) -> SweeperThread:
    """The TTL / stale-session sweeper of a gateway process (started with the service)."""
    options = SweepOptions(interval_s=settings.sweep_interval_seconds, stale_session_s=settings.stale_session_seconds,
                           incomplete_upload_age_s=settings.s3_incomplete_upload_age_seconds,
                           incomplete_sweep_every_s=settings.s3_incomplete_sweep_interval_seconds)
    return SweeperThread(Sweeper(db, store, options))


def build_gateway_app(settings: ServiceSettings, service: EmbeddedService, *, auth_bus: Any = None) -> Any:
    """The FastAPI app: `gateway.app.create_app(GatewaySettings, control, DatabaseAuthenticator)`; `auth_bus`
    (a `gateway.auth.InvalidationBus`, cluster mode) carries revocations between gateways."""
    try:
        from gateway.app import create_app
        from gateway.auth import DatabaseAuthenticator
        from gateway.settings import GatewaySettings
    except ImportError as exc:
        raise StartupError(f"the HTTP gateway is not available in this checkout ({exc})") from exc
    # The gateway reads its other CARPOOL_* settings itself; the long-poll must agree with our cap.
    gateway_settings = GatewaySettings(long_poll_seconds=settings.long_poll_seconds)
    auth = DatabaseAuthenticator(service.db, cache_seconds=gateway_settings.auth_cache_seconds,
                                 cache_size=gateway_settings.auth_cache_size,
                                 failure_seconds=gateway_settings.auth_failure_cache_seconds,
                                 failure_cache_size=gateway_settings.auth_failure_cache_size, bus=auth_bus)
    from deploy.hub_wiring import hub_service

    return create_app(gateway_settings, service.control, auth, metrics=service.metrics,
                      hub_pushes=hub_service(settings, service.db, service.metrics), admin_database=service.db,
                      pass_token_budget=settings.max_tokens_per_step)


def serve(settings: ServiceSettings) -> None:
    """Build, start and serve until interrupted; the scheduler loops stop gracefully afterwards."""
    import uvicorn

    install_key_redaction()
    logging.getLogger().setLevel(settings.log_level.upper())
    service = build_embedded(settings)
    app = build_gateway_app(settings, service)
    service.start()
    tune_collector()  # after everything startup builds: deploy/gc_tuning.py
    try:
        log.info("serving %s on http://%s:%d", ", ".join(service.engines), settings.host, settings.port)
        # log_config=None: uvicorn's loggers propagate to ours, so their records are redacted too.
        uvicorn.run(app, host=settings.host, port=settings.port, log_config=None,
                    access_log=settings.access_log,
                    timeout_keep_alive=settings.http_keep_alive_seconds)
    finally:
        service.stop()
