"""What every `carpool` command does with its options: settings from the environment with the options the
user passed on top, and failing with a one-line `error: ...` and exit code 1 (a `StartupError` says why).

Light on purpose: every command imports it, so nothing here may pull the service (and torch) in."""

from __future__ import annotations

from typing import Any, NoReturn, TypeVar

import typer
from pydantic_settings import BaseSettings

from services.auth.log_redaction import install_key_redaction

SettingsT = TypeVar("SettingsT", bound=BaseSettings)


def settings_from_options(cls: type[SettingsT], **overrides: Any) -> SettingsT:
    """`cls` from the environment, with the options the user actually passed (not None) on top."""
    from pydantic import ValidationError

    install_key_redaction()
    try:
        return cls(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        fail(f"invalid settings: {exc}")


class StartupError(RuntimeError):
    """Something that keeps the service from starting; the message says what to do about it."""


def fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=1)
