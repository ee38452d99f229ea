"""What a test needs from this machine (PostgreSQL, Redis, a binary) and what happens when it is missing.

On a developer's box a missing service skips the tests that need it, with the reason. In CI (`CI=true`) and
under `make test` (`CARPOOL_TEST_STRICT=1`) it is an error instead: a suite that silently skips its
PostgreSQL, Redis, Ray or browser variants proves nothing about them. `tests/conftest.py` also ends a strict
run with a check that the only skipped tests are the CUDA ones (marker `gpu`).
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest
import redis

from services.db.testing import TEST_POSTGRES_URL_ENV, postgres_unavailable_reason

STRICT_ENV = "CARPOOL_TEST_STRICT"
REDIS_URL_ENV = "CARPOOL_TEST_REDIS_URL"
REDIS_URL = os.environ.get(REDIS_URL_ENV, "redis://127.0.0.1:6379/0")
START_SERVICES = "start them with `make services` (runs .ci/services)"
ALLOWED_SKIP_MARKERS = ("gpu",)
"""Skips a strict run accepts: tests that need CUDA, which CI machines do not have."""


def strict() -> bool:
    """Whether a missing service is an error (CI, `make test`) rather than a skip."""
    flags = (os.environ.get(STRICT_ENV, ""), os.environ.get("CI", ""))
    return any(flag.strip().lower() in ("1", "true", "yes") for flag in flags)


def missing(what: str, reason: str, how_to_fix: str) -> NoReturn:
    """A test cannot run because `what` is missing: fail in strict runs, skip otherwise."""
    message = f"{what} unavailable: {reason}; {how_to_fix}"
    if strict():
        pytest.fail(f"{message} (a strict run — CI=true or {STRICT_ENV}=1 — does not skip it)", pytrace=False)
    pytest.skip(message)


def require_postgres() -> None:
    """The test PostgreSQL server answers (`$CARPOOL_TEST_POSTGRES_URL`, default the local CI server)."""
    reason = postgres_unavailable_reason()
    if reason is not None:
        missing("PostgreSQL", reason, f"{START_SERVICES} or set {TEST_POSTGRES_URL_ENV}")


def require_redis(url: str = REDIS_URL) -> None:
    """The test Redis server answers (`$CARPOOL_TEST_REDIS_URL`, default the local CI server)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        missing("Redis", f"no answer at {url} ({exc})", f"{START_SERVICES} or set {REDIS_URL_ENV}")
    finally:
        client.close()


def require_binary(name: str, package: str) -> str:
    """The path of executable `name`, which the Debian package `package` installs."""
    path = shutil.which(name)
    if path is None:
        missing(f"the `{name}` program", "not on PATH", f"install it (apt-get install {package})")
    return path
