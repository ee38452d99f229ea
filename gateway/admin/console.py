"""What the admin dashboard needs and how its pages answer: the console's wiring, sessions, CSRF, responses.

`AdminConsole` bundles the database, the authenticator (for logging in with an API key), the control
plane's scheduler snapshots and quota standing, the hub push service and the process's metrics. Every
admin response goes through `page` or `redirect`, which set the headers that make the console safe to
expose: a `'self'` Content-Security-Policy, no framing, no caching (a key shown once must not come back
from a cache), no referrer.

`admin_session` resolves the cookie to a live `AdminSession` (else a redirect to the login page);
`check_csrf` compares a form's token with the session's in constant time and refuses a post whose
`Origin` is another site. Bad query parameters raise `BadParam`, answered 400 with the field named.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from sqlalchemy.orm import Session

from gateway.auth import Authenticator
from services.admin.sessions import AdminSession, resolve_session
from services.auth.tenants import Tenant
from services.control.api import RuntimeStats
from services.control.quota_standing import QuotaStanding
from services.db.database import Database
from services.hub.service import HubPushService
from services.metrics import ProcessMetrics

COOKIE = "carpool_admin"
PRELOGIN_COOKIE = "carpool_admin_login"
TEMPLATES_DIR = Path(__file__).with_name("templates")
STATIC_DIR = Path(__file__).with_name("static")
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "frame-ancestors 'none'; form-action 'self'; base-uri 'none'; object-src 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_T = TypeVar("_T")


@dataclass
class AdminConsole:
    """Everything the dashboard reads or changes, handed over by the composition root."""

    database: Database
    auth: Authenticator
    metrics: ProcessMetrics
    runtime_stats: Callable[[], Sequence[RuntimeStats]]
    session_ttl: timedelta
    page_size: int
    templates: Jinja2Templates
    pass_token_budget: int | None = None
    """Tokens the scheduler packs into one pass at most (shown against each pass's size)."""
    quota_standing: Callable[[Tenant], QuotaStanding] | None = None
    """A tenant's token bucket and last refusal from the limiter's store (blocking; None: not known here)."""
    hub_pushes: HubPushService | None = None
    """Retries failed hub pushes (None: hub pushes are not configured on this server)."""

    async def tx(self, work: Callable[[Session], _T]) -> _T:
        """Run `work` in one transaction on a worker thread (the event loop never waits on the database)."""
        def run() -> _T:
            with self.database.sessions.begin() as session:
                return work(session)

        return await asyncio.to_thread(run)


def make_templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=str(TEMPLATES_DIR))  # autoescapes .html: tenant strings render inert
    templates.env.filters["ts"] = _timestamp
    templates.env.filters["size"] = _size
    return templates


def console_of(request: Request) -> AdminConsole:
    console: AdminConsole = request.app.state.admin
    return console


class NotLoggedIn(Exception):
    """No valid session: answered with a redirect to the login page."""


class CsrfRefused(Exception):
    """A form without the session's CSRF token, or posted from another site: answered 403."""


class BadParam(Exception):
    """A query or form value out of range: answered 400, naming the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


async def admin_session(request: Request) -> AdminSession:
    token = request.cookies.get(COOKIE)
    if not token or len(token) > 200:
        raise NotLoggedIn()
    session = await console_of(request).tx(lambda db: resolve_session(db, token))
    if session is None:
        raise NotLoggedIn()
    return session


def check_csrf(request: Request, session: AdminSession, form: dict[str, Any]) -> None:
    if not same_origin(request):
        raise CsrfRefused()
    sent = str(form.get("csrf") or "")
    if not hmac.compare_digest(sent.encode(), session.csrf_token.encode()):
        raise CsrfRefused()


def same_origin(request: Request) -> bool:
    """A browser names the page a form came from in `Origin`; another site's name means a forged post."""
    origin = request.headers.get("origin")
    if origin is None:  # no Origin (non-browser clients, older browsers): the CSRF token alone decides
        return True
    if origin == "null":  # privacy-masked origin: trust only the browser's own same-origin verdict
        return request.headers.get("sec-fetch-site") == "same-origin"
    return urlsplit(origin).netloc == request.headers.get("host", "")


def is_https(request: Request) -> bool:
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto", "").lower() == "https"


def page(request: Request, template: str, context: dict[str, Any], status_code: int = 200) -> HTMLResponse:
    response = console_of(request).templates.TemplateResponse(request, template, context, status_code=status_code)
    response.headers.update(SECURITY_HEADERS)
    return response


def redirect(url: str) -> Response:
    response = RedirectResponse(url, status_code=303)
    response.headers.update(SECURITY_HEADERS)
    return response


def int_param(request: Request, name: str, *, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadParam(name, f"must be a whole number, got {raw[:40]!r}") from None
    if not low <= value <= high:
        raise BadParam(name, f"must be between {low} and {high}, got {value}")
    return value


def text_param(request: Request, name: str, *, max_length: int = 200) -> str | None:
    value = (request.query_params.get(name) or "").strip()
    if len(value) > max_length:
        raise BadParam(name, f"must be at most {max_length} characters")
    return value or None


def now() -> datetime:
    return datetime.now(UTC)


def _timestamp(value: datetime | None) -> str:
    return "—" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _size(value: int | None) -> str:
    if value is None:
        return "—"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)
