"""Column types shared by every table, chosen to behave the same on PostgreSQL and SQLite.

- `UtcDateTime`: timezone-aware UTC datetimes in and out. PostgreSQL stores `timestamptz`; SQLite has no
  time zone support, so values are normalised to UTC before they are written as text and re-tagged as UTC
  when read back. Naive datetimes are rejected instead of being silently interpreted in local time.
- `JSON_DOCUMENT`: JSON, stored as JSONB on PostgreSQL (indexable, compact) and as text on SQLite.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator, TypeEngine

JSON_DOCUMENT: TypeEngine[Any] = JSON().with_variant(JSONB(), "postgresql")


def utcnow() -> datetime:
    """The current time as an aware UTC datetime (what every timestamp column expects)."""
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """A `DateTime(timezone=True)` that only accepts and only returns aware UTC datetimes."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware datetime (e.g. utcnow())")
        value = value.astimezone(UTC)
        # SQLite keeps the text without an offset; dropping it after converting to UTC keeps the stored
        # strings comparable with each other, which ORDER BY and range filters rely on.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)
