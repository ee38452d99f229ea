"""The cluster commands of the `carpool` CLI: `cluster up`, `scheduler` and `worker`.

Thin typer wrappers over `deploy.cluster_up`; options become `ClusterSettings` overrides, everything else
comes from `CARPOOL_*` variables (docs/configuration.md, "Cluster"). `carpool serve --mode cluster` (the
gateway alone) lives with `serve` in `deploy.commands`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from deploy.options import fail, settings_from_options
from deploy.settings import ClusterSettings

cluster_app = typer.Typer(no_args_is_help=True, help="Run Carpool as a cluster (Ray workers, schedulers, gateway).")


def cluster_settings(**overrides: Any) -> ClusterSettings:
    return settings_from_options(ClusterSettings, **overrides)


def _run(action: Any, *args: Any) -> None:
    from deploy.embedded import StartupError

    try:
        action(*args)
    except StartupError as exc:
        fail(str(exc))


@cluster_app.command("up")
def up(
    port: int | None = typer.Option(None, help="Gateway port [env: CARPOOL_PORT; default 8000]."),
    host: str | None = typer.Option(None, help="Gateway bind address [env: CARPOOL_HOST]."),
    base_model: list[str] | None = typer.Option(
        None, "--base-model", help="Serve NAME=SOURCE (repeatable) [env: CARPOOL_BASE_MODELS]."),
    replicas: int | None = typer.Option(None, help="Worker replicas per base model [env: CARPOOL_REPLICAS]."),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Shared state directory [env: CARPOOL_DATA_DIR]."),
) -> None:
    """Start Ray, the workers, a scheduler per base model and the gateway on this box; stop on Ctrl-C."""
    from deploy.cluster_up import cluster_up

    _run(cluster_up, cluster_settings(port=port, host=host, base_models=base_model or None, replicas=replicas,
                                      data_dir=data_dir))


def scheduler(
    base_model: str = typer.Option(..., "--base-model", help="The base model (public name) to schedule."),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Shared state directory [env: CARPOOL_DATA_DIR]."),
) -> None:
    """Run one base model's scheduler: standby until it holds the lease, then active."""
    from deploy.cluster_up import run_scheduler

    _run(run_scheduler, cluster_settings(data_dir=data_dir), base_model)


def worker(
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Shared state directory [env: CARPOOL_DATA_DIR]."),
) -> None:
    """Deploy the Ray Serve worker replicas (CARPOOL_RAY_ADDRESS, or a local Ray) and keep them running."""
    from deploy.cluster_up import run_workers

    _run(run_workers, cluster_settings(data_dir=data_dir))


def serve_cluster_gateway(overrides: dict[str, Any]) -> None:
    """`carpool serve --mode cluster`: the gateway alone, against the cluster's Postgres and Redis."""
    from deploy.cluster_gateway import serve_cluster_gateway as serve

    _run(serve, cluster_settings(**overrides))


def register(app: typer.Typer) -> None:
    """Add these commands to the `carpool` app."""
    app.add_typer(cluster_app, name="cluster")
    app.command("scheduler")(scheduler)
    app.command("worker")(worker)
