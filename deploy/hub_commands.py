"""`carpool hub-worker`: the Celery worker that executes hub pushes in cluster mode.

`carpool serve` needs no such process (it runs pushes in-process); in cluster mode run one or more hub
workers next to the gateways, with the same `CARPOOL_DATABASE_URL`, `CARPOOL_REDIS_URL` (or
`CARPOOL_HUB_BROKER_URL`), `CARPOOL_SECRET_KEY` and checkpoint storage settings.
"""

from __future__ import annotations

from pathlib import Path

import typer

from deploy.cluster_commands import cluster_settings
from deploy.options import StartupError, fail


def hub_worker(
    concurrency: int = typer.Option(2, min=1, help="Pushes run at once by this worker."),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Scratch space [env: CARPOOL_DATA_DIR]."),
) -> None:
    """Execute hub pushes (Hugging Face, ModelScope) from the Celery queue on the Redis broker, until SIGTERM."""
    from deploy.hub_wiring import hub_cipher, run_hub_worker

    settings = cluster_settings(data_dir=data_dir)
    try:
        hub_cipher(settings)  # refuse to start without the server key before connecting anywhere
        run_hub_worker(settings, concurrency=concurrency)
    except StartupError as exc:
        fail(str(exc))


def register(app: typer.Typer) -> None:
    app.command("hub-worker")(hub_worker)
