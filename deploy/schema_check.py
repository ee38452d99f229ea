"""`carpool migrate --check`: whether the configured database is at exactly this code's schema.

Gateways and schedulers already refuse to start on another schema (`open_database(..., migrate=False)`);
this is the same check as a command, so a Kubernetes init container can hold a pod until the release's
migration Job has run, with a message in the pod's events instead of a crash loop of the main container.
"""

from __future__ import annotations

from sqlalchemy.exc import OperationalError

from deploy.settings import ServiceSettings
from services.db.schema import SchemaVersionError, check_at_head


def schema_problem(settings: ServiceSettings) -> str | None:
    """None when the database is current; else what is wrong and what to do about it."""
    url = settings.resolved_database_url()
    try:
        check_at_head(url)
    except SchemaVersionError as exc:
        return str(exc)
    except OperationalError as exc:
        return f"database unreachable: {exc.orig}\nFix: start PostgreSQL or set CARPOOL_DATABASE_URL."
    return None
