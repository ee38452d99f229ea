"""Alembic migrations: head matches the models exactly, downgrade/upgrade round-trips, CLI and API agree."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from services.db import DATABASE_URL_ENV, database_url_for_data_dir, make_engine
from services.db.models import Base
from services.db.schema import current_revision, downgrade_to_base, head_revision, upgrade_to_head
from services.db.testing import scratch_postgres_database
from tests.required import require_postgres

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def postgres_available() -> None:
    require_postgres()


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database per test."""
    if request.param == "sqlite":
        yield database_url_for_data_dir(tmp_path)
        return
    request.getfixturevalue("postgres_available")
    with scratch_postgres_database(prefix="carpool_migr") as url:
        yield url


def _schema_diff(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_matches_models_and_round_trips(empty_url: str) -> None:
    assert current_revision(empty_url) is None
    upgrade_to_head(empty_url)
    assert current_revision(empty_url) == head_revision()
    assert _schema_diff(empty_url) == []
    assert _tables(empty_url) >= set(Base.metadata.tables)

    downgrade_to_base(empty_url)
    assert current_revision(empty_url) is None
    assert _tables(empty_url) <= {"alembic_version"}

    upgrade_to_head(empty_url)
    assert current_revision(empty_url) == head_revision()
    assert _schema_diff(empty_url) == []


def test_upgrade_is_idempotent(empty_url: str) -> None:
    upgrade_to_head(empty_url)
    upgrade_to_head(empty_url)
    assert current_revision(empty_url) == head_revision()


def test_diff_detects_drift(empty_url: str) -> None:
    """Guard the guard: the comparison must notice a schema that differs from the models."""
    upgrade_to_head(empty_url)
    engine = make_engine(empty_url)
    try:
        with engine.begin() as connection:
            connection.exec_driver_sql("DROP INDEX ix_requests_pass_id")
    finally:
        engine.dispose()
    assert _schema_diff(empty_url) != []


def test_concurrent_upgrades_on_postgres(postgres_available: None) -> None:
    """Replicas starting together: the advisory lock serialises them and all end at head.

    Separate processes, as in production (Alembic's `context`/`op` proxies are process-global).
    """
    script = "import sys; from services.db.schema import upgrade_to_head; upgrade_to_head(sys.argv[1])"
    with scratch_postgres_database(prefix="carpool_migr") as url:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script, url], cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True
            )
            for _ in range(4)
        ]
        errors = [proc.communicate(timeout=120)[1] for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0, 0, 0], errors
        assert current_revision(url) == head_revision()
        assert _schema_diff(url) == []


def _alembic_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, DATABASE_URL_ENV: url}
    return subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(REPO_ROOT / "alembic.ini"), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_alembic_cli_uses_the_env_url(empty_url: str) -> None:
    upgraded = _alembic_cli(empty_url, "upgrade", "head")
    assert upgraded.returncode == 0, upgraded.stderr
    assert current_revision(empty_url) == head_revision()
    # `alembic check` fails if autogenerate would produce a new migration.
    checked = _alembic_cli(empty_url, "check")
    assert checked.returncode == 0, checked.stderr
    downgraded = _alembic_cli(empty_url, "downgrade", "base")
    assert downgraded.returncode == 0, downgraded.stderr
    assert current_revision(empty_url) is None
