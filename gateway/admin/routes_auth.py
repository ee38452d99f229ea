"""Logging in to the dashboard with an admin API key, and out.

A login form carries a one-time token that must match a cookie set with the form (login CSRF: another
site cannot log a browser in with the attacker's key). A valid admin key opens a server-side session
(`services.admin.sessions`); its token goes into an HttpOnly, SameSite=Strict cookie scoped to `/admin`,
Secure when the dashboard is reached over https. A key of a non-admin tenant gets 403 and nothing else.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from sqlalchemy.orm import Session

from gateway.admin.console import (
    COOKIE,
    PRELOGIN_COOKIE,
    AdminConsole,
    admin_session,
    check_csrf,
    console_of,
    is_https,
    page,
    redirect,
    same_origin,
)
from services.admin.sessions import AdminSession, close_session, open_session, purge_expired
from services.auth.tenants import Tenant

router = APIRouter()
MAX_KEY_LENGTH = 200


def _login_page(request: Request, *, error: str | None = None, status_code: int = 200) -> Response:
    token = secrets.token_urlsafe(24)
    response = page(request, "login.html", {"csrf": token, "error": error}, status_code)
    response.set_cookie(PRELOGIN_COOKIE, token, httponly=True, samesite="strict", secure=is_https(request),
                        path="/admin", max_age=3600)
    return response


@router.get("/login")
async def login_form(request: Request) -> Response:
    return _login_page(request)


@router.post("/login")
async def login(request: Request) -> Response:
    form = await request.form()
    expected = request.cookies.get(PRELOGIN_COOKIE, "")
    sent = str(form.get("csrf") or "")
    if not same_origin(request) or not expected or not hmac.compare_digest(sent.encode(), expected.encode()):
        return page(request, "error.html", {"title": "Forbidden", "message": "The login form expired or was "
                                            "posted from another site; open the login page again."}, 403)
    key = str(form.get("api_key") or "").strip()
    if not key:
        return _login_page(request, error="Enter an admin API key (tml-...).", status_code=400)
    if len(key) > MAX_KEY_LENGTH:
        return _login_page(request, error=f"An API key is at most {MAX_KEY_LENGTH} characters.", status_code=400)
    console = console_of(request)
    tenant = await console.auth.authenticate(key)
    if tenant is None:
        request.app.state.metrics.auth_failed("rejected")
        return _login_page(request, error="This key is unknown, revoked, or its tenant is disabled.",
                           status_code=401)
    if not tenant.is_admin or tenant.api_key_id is None:
        request.app.state.metrics.auth_failed("forbidden")
        return page(request, "error.html", {"title": "Forbidden", "message": "This key belongs to a tenant "
                                            "without admin rights; the dashboard is for operators."}, 403)
    return await _open(request, console, tenant)


async def _open(request: Request, console: AdminConsole, tenant: Tenant) -> Response:
    assert tenant.api_key_id is not None

    def work(db: Session) -> str:
        purge_expired(db)
        return open_session(db, tenant_id=tenant.id, api_key_id=tenant.api_key_id, ttl=console.session_ttl)

    token = await console.tx(work)
    response = redirect("/admin/")
    response.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=is_https(request), path="/admin",
                        max_age=int(console.session_ttl.total_seconds()))
    response.delete_cookie(PRELOGIN_COOKIE, path="/admin")
    return response


@router.post("/logout")
async def logout(request: Request, session: Annotated[AdminSession, Depends(admin_session)]) -> Response:
    check_csrf(request, session, dict(await request.form()))
    token = request.cookies.get(COOKIE, "")
    await console_of(request).tx(lambda db: close_session(db, token))
    response = redirect("/admin/login")
    response.delete_cookie(COOKIE, path="/admin")
    return response
