"""Support for tests that need a real database: throwaway PostgreSQL databases and table wiping.

Test suites (this package's and the gateway's) create one scratch database per run with
`scratch_postgres_database()`, migrate it with `schema.upgrade_to_head`, and `wipe_tables` between tests.
The server comes from `$CARPOOL_TEST_POSTGRES_URL` (any database on it; used only to create and drop the
scratch one), defaulting to the local CI server. Nothing here runs in production code paths.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine, delete, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from services.db.engine import normalize_database_url
from services.db.models import Base

TEST_POSTGRES_URL_ENV = "CARPOOL_TEST_POSTGRES_URL"
DEFAULT_TEST_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
CONNECT_TIMEOUT_S = 3


def postgres_admin_url_for_tests() -> str:
    """The server to create scratch databases on: `$CARPOOL_TEST_POSTGRES_URL` or the local default."""
    return normalize_database_url(os.environ.get(TEST_POSTGRES_URL_ENV) or DEFAULT_TEST_POSTGRES_URL)


def _admin_engine(admin_url: str) -> Engine:
    # CREATE/DROP DATABASE cannot run inside a transaction block; NullPool so no connection lingers.
    return create_engine(
        admin_url,
        isolation_level="AUTOCOMMIT",
        poolclass=NullPool,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_S},
    )


def postgres_unavailable_reason(admin_url: str | None = None) -> str | None:
    """None if the PostgreSQL server answers, else a one-line reason (the server is not there).

    Only "nobody answers" counts as unavailable. A server that answers and refuses us (bad password, a
    database that does not exist) or a malformed URL is a broken test setup, so it raises instead: turning
    it into a skip would hide every PostgreSQL test behind a typo.
    """
    url = admin_url or postgres_admin_url_for_tests()
    engine = _admin_engine(url)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except OperationalError as exc:
        if not _nobody_answers(exc):
            raise
        shown = make_url(url).render_as_string(hide_password=True)
        return f"PostgreSQL unreachable at {shown} (set {TEST_POSTGRES_URL_ENV}): {_first_line(exc)}"
    finally:
        engine.dispose()
    return None


_NOBODY_ANSWERS = ("connection refused", "timeout expired", "could not connect", "no such file or directory",
                   "connection timed out", "network is unreachable", "the database system is starting up",
                   "the database system is shutting down")
"""libpq's words for a server that is not (yet) there, as opposed to one that refuses us."""


def _nobody_answers(exc: OperationalError) -> bool:
    message = str(exc.orig if exc.orig is not None else exc).lower()
    refused_us = "authentication failed" in message or "does not exist" in message
    return not refused_us and any(words in message for words in _NOBODY_ANSWERS)


def _first_line(exc: BaseException) -> str:
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return lines[0] if lines else exc.__class__.__name__


@contextmanager
def scratch_postgres_database(admin_url: str | None = None, prefix: str = "carpool_test") -> Iterator[str]:
    """Create an empty database with a random name, yield its URL, and drop it afterwards."""
    admin = admin_url or postgres_admin_url_for_tests()
    name = f"{prefix}_{secrets.token_hex(6)}"
    engine = _admin_engine(admin)
    try:
        with engine.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        with engine.connect() as connection:
            # FORCE (PostgreSQL 13+) ends sessions a test leaked instead of failing the drop.
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        engine.dispose()


def wipe_tables(engine: Engine) -> None:
    """Delete every row of every Carpool table (children first), keeping the schema and its version."""
    with engine.begin() as connection:
        for table in reversed(Base.metadata.sorted_tables):
            connection.execute(delete(table))
