"""The service commands of the `carpool` CLI: `serve`, `migrate`, `tenants ...` (incl. `set-quota`), `keys ...`.

Thin typer wrappers: options become `ServiceSettings` overrides (so `--data-dir` beats
`$CARPOOL_DATA_DIR`, which beats the default `./data`; `$CARPOOL_DATABASE_URL` picks another database),
the work happens in `deploy.admin` and `deploy.embedded`. A new API key is printed on the LAST line of
the output, alone, so scripts can take it with `tail -n 1`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from deploy.options import fail, settings_from_options
from deploy.settings import ServiceSettings

DATA_DIR_HELP = "State directory (database, checkpoints) [env: CARPOOL_DATA_DIR; default: ./data]."

tenants_app = typer.Typer(no_args_is_help=True, help="Manage tenants (accounts).")
keys_app = typer.Typer(no_args_is_help=True, help="Manage API keys.")


def _data_dir_option() -> Any:
    return typer.Option(None, "--data-dir", help=DATA_DIR_HELP, show_default=False)


def _settings(**overrides: Any) -> ServiceSettings:
    return settings_from_options(ServiceSettings, **overrides)


def serve(
    base_model: list[str] | None = typer.Option(
        None, "--base-model", help="Serve NAME=SOURCE (repeatable) [env: CARPOOL_BASE_MODELS]."
    ),
    host: str | None = typer.Option(None, help="Bind address [env: CARPOOL_HOST; default 127.0.0.1]."),
    port: int | None = typer.Option(None, help="Port [env: CARPOOL_PORT; default 8000]."),
    data_dir: Path | None = _data_dir_option(),
    device: str | None = typer.Option(None, help="Torch device [env: CARPOOL_DEVICE]."),
    dtype: str | None = typer.Option(None, help="Torch dtype [env: CARPOOL_DTYPE]."),
    mode: str = typer.Option("embedded", "--mode", help=(
        "embedded: everything in this process. cluster: the gateway only, against the cluster's PostgreSQL "
        "and Redis (workers and schedulers run elsewhere).")),
) -> None:
    """Run the whole service in this process: HTTP gateway, scheduler and one worker per base model."""
    from deploy.embedded import StartupError
    from deploy.embedded import serve as run_service

    overrides = {"base_models": base_model or None, "host": host, "port": port, "data_dir": data_dir,
                 "device": device, "dtype": dtype}
    if mode == "cluster":
        from deploy.cluster_commands import serve_cluster_gateway

        serve_cluster_gateway(overrides)
        return
    if mode != "embedded":
        fail(f"--mode must be embedded or cluster, got {mode!r}")
    settings = _settings(**overrides)
    try:
        run_service(settings)
    except StartupError as exc:
        fail(str(exc))


def migrate(
    data_dir: Path | None = _data_dir_option(),
    check: bool = typer.Option(False, "--check", help=(
        "Change nothing: exit 0 when the database is at this code's schema, else 1 saying why (the init "
        "check of gateway and scheduler pods).")),
) -> None:
    """Upgrade the configured database to the current schema (run once per release in production)."""
    from deploy.admin import migrate as run_migrate

    settings = _settings(data_dir=data_dir)
    if check:
        from deploy.schema_check import schema_problem

        problem = schema_problem(settings)
        if problem:
            fail(problem)
        typer.echo("database schema is current")
        return
    typer.echo(f"database at revision {run_migrate(settings)}")


@tenants_app.command("create")
def tenants_create(
    name: str = typer.Argument(..., help="Unique tenant name."),
    admin: bool = typer.Option(False, "--admin", help="Give the tenant admin rights."),
    max_models: int | None = typer.Option(None, help="Most models the tenant may hold at once."),
    data_dir: Path | None = _data_dir_option(),
) -> None:
    """Create a tenant with a first API key; the key is printed once, alone on the last line."""
    from deploy.admin import AdminError, create_tenant

    try:
        settings = _settings(data_dir=data_dir)
        tenant, issued = create_tenant(settings, name, is_admin=admin, max_models=max_models)
    except AdminError as exc:
        fail(str(exc))
    role = "admin tenant" if tenant.is_admin else "tenant"
    typer.echo(f"created {role} {tenant.name} ({tenant.id}); its API key is shown this once:")
    typer.echo(issued.key)


@tenants_app.command("set-quota")
def tenants_set_quota(
    name: str = typer.Argument(..., help="Tenant name (or id)."),
    tokens_per_minute: int | None = typer.Option(None, help="Tokens the tenant may submit per minute (0: no limit)."),
    max_concurrent: int | None = typer.Option(None, help="Unfinished requests the tenant may have (0: no limit)."),
    max_models: int | None = typer.Option(None, help="Models the tenant may hold at once (0: no limit)."),
    max_checkpoints: int | None = typer.Option(None, help="Checkpoints the tenant may store (0: no limit)."),
    max_checkpoint_bytes: int | None = typer.Option(None, help="Bytes of stored checkpoints (0: no limit)."),
    max_sessions: int | None = typer.Option(None, help="Unfinished sessions (0: no limit)."),
    max_sampling_sessions: int | None = typer.Option(None, help="Sampling sessions (0: no limit)."),
    data_dir: Path | None = _data_dir_option(),
) -> None:
    """Change a tenant's quotas; options left out keep their value. Over a quota, requests get HTTP 429."""
    from deploy.admin import AdminError, set_quotas

    try:
        tenant, quotas = set_quotas(_settings(data_dir=data_dir), name, tokens_per_minute=tokens_per_minute,
                                    max_concurrent_requests=max_concurrent, max_models=max_models,
                                    max_checkpoints=max_checkpoints, max_checkpoint_bytes=max_checkpoint_bytes,
                                    max_sessions=max_sessions, max_sampling_sessions=max_sampling_sessions)
    except AdminError as exc:
        fail(str(exc))

    def shown(value: int | None) -> str:
        return "unlimited" if value is None else str(value)

    typer.echo(f"quotas of {tenant}: tokens_per_minute={shown(quotas.tokens_per_minute)} "
               f"max_concurrent={shown(quotas.max_concurrent_requests)} max_models={shown(quotas.max_models)}")


def _redis_url_option() -> Any:
    return typer.Option(None, "--redis-url", envvar="CARPOOL_REDIS_URL", help=(
        "Cluster mode: tell every gateway through this Redis, so cached logins end at once "
        "[env: CARPOOL_REDIS_URL]; without it they end within CARPOOL_AUTH_CACHE_SECONDS."))


def _redis_prefix_option() -> Any:
    return typer.Option("carpool", "--redis-prefix", envvar="CARPOOL_REDIS_PREFIX",
                        help="The cluster's Redis key prefix [env: CARPOOL_REDIS_PREFIX].")


@tenants_app.command("disable")
def tenants_disable(
    name: str = typer.Argument(..., help="Tenant name (or id)."),
    enable: bool = typer.Option(False, "--enable", help="Re-enable the tenant instead."),
    data_dir: Path | None = _data_dir_option(),
    redis_url: str | None = _redis_url_option(),
    redis_prefix: str = _redis_prefix_option(),
) -> None:
    """Disable a tenant (its keys stop authenticating) or, with --enable, re-enable it. Audited."""
    from deploy.admin import AdminError, redis_announcer, set_disabled

    try:
        tenant = set_disabled(_settings(data_dir=data_dir), name, not enable,
                              announce=redis_announcer(redis_url, redis_prefix))
    except AdminError as exc:
        fail(str(exc))
    typer.echo(f"{'enabled' if enable else 'disabled'} {tenant}")


@tenants_app.command("list")
def tenants_list(data_dir: Path | None = _data_dir_option()) -> None:
    """List tenants with their live key counts and quotas ("-": the server default applies)."""
    from deploy.admin import tenant_summaries

    rows = tenant_summaries(_settings(data_dir=data_dir))
    typer.echo(f"{'NAME':<24} {'ID':<32} {'ADMIN':<6} {'DISABLED':<9} {'KEYS':<5} {'MAX_MODELS':<11} "
               f"{'TOKENS/MIN':<11} MAX_CONCURRENT")
    for t in rows:
        limits = ["-" if v is None else str(v) for v in (t.max_models, t.tokens_per_minute,
                                                         t.max_concurrent_requests)]
        typer.echo(f"{t.name:<24} {t.id:<32} {str(t.is_admin).lower():<6} {str(t.disabled).lower():<9} "
                   f"{t.live_keys:<5} {limits[0]:<11} {limits[1]:<11} {limits[2]}")


@keys_app.command("create")
def keys_create(
    tenant: str = typer.Argument(..., help="Tenant name (or id)."),
    data_dir: Path | None = _data_dir_option(),
) -> None:
    """Issue another API key for a tenant; printed once, alone on the last line."""
    from deploy.admin import AdminError, create_key

    try:
        name, issued = create_key(_settings(data_dir=data_dir), tenant)
    except AdminError as exc:
        fail(str(exc))
    typer.echo(f"new API key for {name} (prefix {issued.prefix}); it is shown this once:")
    typer.echo(issued.key)


@keys_app.command("revoke")
def keys_revoke(
    key_prefix: str = typer.Argument(..., help="The key's 12-character prefix (e.g. tml-AbCdEfGh)."),
    data_dir: Path | None = _data_dir_option(),
    redis_url: str | None = _redis_url_option(),
    redis_prefix: str = _redis_prefix_option(),
) -> None:
    """Revoke API keys by their display prefix."""
    from deploy.admin import AdminError, redis_announcer, revoke_keys

    try:
        count = revoke_keys(_settings(data_dir=data_dir), key_prefix, announce=redis_announcer(redis_url, redis_prefix))
    except AdminError as exc:
        fail(str(exc))
    typer.echo(f"revoked {count} key{'s' if count != 1 else ''}")


def register(app: typer.Typer) -> None:
    """Add these commands to the `carpool` app."""
    app.command("serve")(serve)
    app.command("migrate")(migrate)
    app.add_typer(tenants_app, name="tenants")
    app.add_typer(keys_app, name="keys")
