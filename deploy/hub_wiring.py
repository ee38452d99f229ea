"""Hub pushes from settings: the server key, the hub clients, the push runner, and who executes pushes.

`carpool serve` runs pushes on threads of its own process (`InProcessDispatcher`), so `make run` needs
nothing more; cluster gateways send them through Celery on the Redis broker and `carpool hub-worker`
executes them (`run_hub_worker`). Both build the same `PushRunner`. Cluster mode refuses to start without
`CARPOOL_SECRET_KEY`: every gateway and hub worker must decrypt the same stored tokens.
"""

from __future__ import annotations

import logging
from typing import Any

from deploy.embedded import StartupError
from deploy.hub_heartbeat import install_heartbeat
from deploy.settings import ClusterSettings, ServiceSettings
from deploy.storage_wiring import checkpoint_store
from services.db import Database
from services.db.hub_pushes import unfinished_hub_push_ids
from services.db.models import HubTarget
from services.hub.clients import HubClient, HuggingFaceClient, ModelScopeClient, UnavailableClient
from services.hub.credentials import CredentialError, TokenCipher
from services.hub.dispatch import CeleryDispatcher, InProcessDispatcher, celery_app, register_push_task
from services.hub.runner import PushRunner
from services.hub.service import HubPushService
from services.metrics import ProcessMetrics, start_metrics_server
from services.storage import load_or_create_secret

log = logging.getLogger(__name__)

RETRY_BACKOFF_S = 2.0


def hub_cipher(settings: ServiceSettings) -> TokenCipher:
    """The key hub tokens are encrypted with: `CARPOOL_SECRET_KEY`, else (serve only) one kept in the data dir."""
    if settings.secret_key is not None:
        try:
            return TokenCipher.from_setting(settings.secret_key.get_secret_value())
        except CredentialError as exc:
            raise StartupError(str(exc)) from exc
    if isinstance(settings, ClusterSettings):
        raise StartupError("cluster mode needs CARPOOL_SECRET_KEY (32+ characters, the same in every gateway "
                           "and hub worker): it encrypts tenants' hub tokens at rest.\n"
                           "Fix: export CARPOOL_SECRET_KEY=$(openssl rand -hex 32)")
    return TokenCipher(load_or_create_secret(settings.hub_secret_path))


def operator_tokens(settings: ServiceSettings) -> dict[HubTarget, str]:
    tokens = {"hf": settings.hub_token_huggingface, "ms": settings.hub_token_modelscope}
    return {target: secret.get_secret_value() for target, secret in tokens.items()  # type: ignore[misc]
            if secret is not None and secret.get_secret_value()}


def hub_clients(settings: ServiceSettings) -> dict[HubTarget, HubClient]:
    """The real clients, with every call bounded by `hub_timeout_seconds` (no push hangs on a dead hub)."""
    import huggingface_hub
    from huggingface_hub import HfApi
    from huggingface_hub.utils import _http

    timeout = settings.hub_timeout_seconds

    def bounded_client() -> Any:
        client = _http.default_client_factory()
        client.timeout = timeout  # huggingface_hub's default is no timeout at all
        return client

    # Process-wide by huggingface_hub's design; this process uses the hub only for pushes.
    huggingface_hub.set_client_factory(bounded_client)
    return {"hf": HuggingFaceClient(HfApi()), "ms": modelscope_client(timeout)}


def modelscope_client(timeout: float) -> HubClient:
    """ModelScope's client; the package comes with the `worker` extra, so a slim hub worker may lack it."""
    try:
        from modelscope.hub.api import HubApi
    except ImportError:
        return UnavailableClient("pushes to ModelScope need the modelscope package in the hub worker's image "
                                 "(pip install modelscope, or the carpool[worker] extra)")
    # Our own retries (with backoff, and none on 401/403/404) replace ModelScope's built-in ones.
    return ModelScopeClient(HubApi(timeout=int(max(1, timeout)), max_retries=0))


def push_runner(settings: ServiceSettings, db: Database, *,
                clients: dict[HubTarget, HubClient] | None = None, metrics: ProcessMetrics | None = None) -> PushRunner:
    on_finished = metrics.runtime.hub_push_finished if metrics is not None else None
    return PushRunner(db, checkpoint_store(settings), clients or hub_clients(settings), hub_cipher(settings),
                      operator_tokens=operator_tokens(settings), max_retries=settings.hub_push_max_retries,
                      backoff_s=RETRY_BACKOFF_S, scratch_dir=settings.scratch_dir, on_finished=on_finished)


def hub_service(settings: ServiceSettings, db: Database, metrics: ProcessMetrics | None = None) -> HubPushService:
    """What the gateway serves `/v1/hub_pushes` with, for this mode."""
    cipher = hub_cipher(settings)
    if isinstance(settings, ClusterSettings):
        dispatcher: Any = CeleryDispatcher(celery_app(broker_url(settings), prefix=settings.redis_prefix))
    else:
        dispatcher = InProcessDispatcher(push_runner(settings, db, metrics=metrics))
        with db.sessions.begin() as session:
            dispatcher.resume(unfinished_hub_push_ids(session))  # left by a previous run of this server
    operator = operator_tokens(settings)
    return HubPushService(db, cipher, dispatcher, operator_hubs={t: True for t in operator})


def broker_url(settings: ClusterSettings) -> str:
    return settings.hub_broker_url or settings.redis_url


def run_hub_worker(settings: ClusterSettings, *, concurrency: int = 2) -> None:
    """`carpool hub-worker`: a Celery worker executing hub pushes until SIGTERM."""
    from deploy.cluster_wiring import open_cluster_database

    db = open_cluster_database(settings)
    app = celery_app(broker_url(settings), prefix=settings.redis_prefix)
    metrics = ProcessMetrics.create()
    if settings.metrics_port is not None:  # the worker serves no HTTP otherwise; the port lives as long as it
        start_metrics_server(metrics.registry, host=settings.host, port=settings.metrics_port)
    register_push_task(app, push_runner(settings, db, metrics=metrics))
    install_heartbeat(app, settings.hub_heartbeat_file)
    log.info("hub worker consuming %s on %s", app.conf.task_default_queue, broker_url(settings).split("@")[-1])
    worker = app.Worker(pool="threads", concurrency=concurrency, loglevel="INFO",
                        queues=[app.conf.task_default_queue], without_gossip=True, without_mingle=True)
    worker.start()
