"""The `carpool` command line: a typer app that wires user commands to gateway and worker code.

Commands are plain functions registered on `app`, so other modules can add commands or sub-apps
(`app.add_typer(...)`) without touching these. Heavy imports (torch, transformers) happen inside the
commands, so `carpool --help` and unrelated commands start fast.
"""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from deploy.cluster_commands import register as register_cluster_commands
from deploy.commands import register as register_service_commands
from deploy.hub_commands import register as register_hub_commands
from deploy.options import fail
from deploy.storage_commands import register as register_storage_commands

app = typer.Typer(no_args_is_help=True, help="Carpool: multi-tenant LoRA training on a shared base model.")


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug output."),
) -> None:
    """Carpool: multi-tenant LoRA training on a shared base model."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def dev_model(
    path: Path = typer.Argument(..., help="Directory to write the model into."),
    layers: int = typer.Option(2, help="Number of transformer layers."),
    hidden: int = typer.Option(64, help="Hidden size."),
    vocab: int = typer.Option(512, help="Tokenizer and embedding vocabulary size."),
    seed: int = typer.Option(0, help="Seed for the random weights."),
) -> None:
    """Write a tiny random-weight Qwen3 model with its own tokenizer, for offline development."""
    from worker.models.devmodel import build_dev_model

    try:
        out = build_dev_model(path, layers=layers, hidden=hidden, vocab=vocab, seed=seed)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(str(out))


def fetch_model(
    source: str = typer.Argument(
        ..., help="Local dir, hf://org/name[@rev], ms://org/name, gguf://file, or alias."
    ),
    cache_dir: Path | None = typer.Option(
        None, help="Cache for converted models [default: $CARPOOL_CACHE_DIR]."
    ),
) -> None:
    """Resolve a base-model source to a local directory (converting GGUF once) and print it."""
    from worker.models.sources import ModelSourceError, default_cache_dir, resolve_model_source

    try:
        out = resolve_model_source(source, cache_dir or default_cache_dir())
    except ModelSourceError as exc:
        fail(str(exc))
    typer.echo(str(out))




app.command("dev-model")(dev_model)
app.command("fetch-model")(fetch_model)
register_service_commands(app)
register_cluster_commands(app)
register_hub_commands(app)
register_storage_commands(app)


def main() -> None:
    """Console-script entry point (`carpool`)."""
    app()


if __name__ == "__main__":
    main()
