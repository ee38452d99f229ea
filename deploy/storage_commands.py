"""`carpool storage sweep`: remove what killed uploads left in S3 checkpoint storage.

A checkpoint becomes visible only when its manifest is written last, so an upload cut short (a worker
killed mid-save) leaves objects nobody can load, plus unfinished multipart uploads. This command removes
both once they are older than `--older-than` seconds (so an upload in progress is never touched). Every
gateway's sweeper already does this on its own (`CARPOOL_S3_INCOMPLETE_UPLOAD_AGE_SECONDS`); this command
is for doing it now, by hand. With local storage there is nothing to do.
"""

from __future__ import annotations

import typer

from deploy.options import fail, settings_from_options
from deploy.settings import ServiceSettings

storage_app = typer.Typer(no_args_is_help=True, help="Checkpoint storage maintenance.")


@storage_app.command("sweep")
def sweep(
    older_than: float = typer.Option(3600.0, "--older-than", min=0,
                                     help="Only debris older than this many seconds."),
) -> None:
    """Delete objects of checkpoints that never got their manifest, and abort stale multipart uploads."""
    from deploy.storage_wiring import checkpoint_store
    from services.storage import StorageError
    from services.storage.s3 import S3CheckpointStore

    settings = settings_from_options(ServiceSettings)
    store = checkpoint_store(settings)
    if not isinstance(store, S3CheckpointStore):
        typer.echo("checkpoints are on local disk (CARPOOL_STORAGE_URL unset): nothing to sweep")
        return
    try:
        removed = store.sweep_incomplete(older_than_s=older_than)
    except StorageError as exc:
        fail(str(exc))
    typer.echo(f"removed {removed} objects of incomplete checkpoints under s3://{store.location.bucket}/"
               f"{store.location.prefix}")


def register(app: typer.Typer) -> None:
    app.add_typer(storage_app, name="storage")
