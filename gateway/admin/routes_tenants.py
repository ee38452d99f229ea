"""Tenants, their quotas and API keys: the dashboard's write side, every change audited.

Forms post back here with the session's CSRF token; a bad field re-renders the form with a 400 and the
message next to that field (never a 500). New keys are shown once, on a page that is never cached. A key
revoked or a tenant disabled here stops working at once on this gateway and, through the invalidation bus,
on the others (`Authenticator.announce`), not when their caches expire.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from sqlalchemy.orm import Session

from gateway.admin.console import BadParam, admin_session, check_csrf, console_of, int_param, now, page, redirect
from gateway.admin.console import text_param as text_query
from services.admin import actions, queries
from services.admin.actions import Actor
from services.admin.sessions import AdminSession
from services.auth.invalidation import Invalidation
from services.auth.tenants import IssuedKey
from services.db.errors import ConflictError
from services.db.ids import ApiKeyId, TenantId
from services.db.models import TenantRow
from services.db.tenants import TenantQuotas, get_tenant, get_tenant_by_name

router = APIRouter()
Admin = Annotated[AdminSession, Depends(admin_session)]
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._@-]{0,99}")
QUOTA_FIELDS = ("tokens_per_minute", "max_concurrent_requests", "max_models")
MAX_QUOTA = 1_000_000_000


def _actor(session: AdminSession) -> Actor:
    return Actor(session.tenant_id, session.key_prefix)


@dataclass
class FormErrors:
    fields: dict[str, str]

    def __bool__(self) -> bool:
        return bool(self.fields)


def parse_quotas(form: dict[str, Any], errors: FormErrors) -> TenantQuotas:
    """Empty or 0: no tenant limit (the server default applies); otherwise a whole number in range."""
    values: dict[str, int | None] = {}
    for name in QUOTA_FIELDS:
        raw = str(form.get(name) or "").strip()
        values[name] = None
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            errors.fields[name] = f"must be a whole number, got {raw[:40]!r}"
            continue
        if value < 0:
            errors.fields[name] = "must not be negative (leave empty or 0 for no limit)"
        elif value > MAX_QUOTA:
            errors.fields[name] = f"must be at most {MAX_QUOTA}"
        else:
            values[name] = value or None
    return TenantQuotas(max_models=values["max_models"], tokens_per_minute=values["tokens_per_minute"],
                        max_concurrent_requests=values["max_concurrent_requests"])


def _tenants_context(request: Request, db: Session, session: AdminSession) -> dict[str, Any]:
    console = console_of(request)
    offset = int_param(request, "offset", default=0, low=0, high=10_000_000)
    prefix = text_query(request, "q")
    listing = queries.tenants(db, queries.Page(console.page_size, offset), today=queries.day_start(now()),
                              name_prefix=prefix)
    return {"session": session, "listing": listing, "q": prefix or "", "active": "tenants"}


@router.get("/tenants")
async def tenants_page(request: Request, session: Admin) -> Response:
    context = await console_of(request).tx(lambda db: _tenants_context(request, db, session))
    return page(request, "tenants.html", {**context, "form": {}, "errors": {}})


@router.post("/tenants")
async def create_tenant(request: Request, session: Admin) -> Response:
    form = dict(await request.form())
    check_csrf(request, session, form)
    errors = FormErrors({})
    name = str(form.get("name") or "").strip()
    if not name:
        errors.fields["name"] = "is required"
    elif not NAME_PATTERN.fullmatch(name):
        errors.fields["name"] = ("1-100 characters: letters, digits, space and . _ @ -, starting with a letter "
                                 "or digit")
    quotas = parse_quotas(form, errors)
    is_admin = form.get("is_admin") == "on"
    console = console_of(request)

    def work(db: Session) -> tuple[str, IssuedKey] | None:
        if errors:
            return None
        if get_tenant_by_name(db, name) is not None:
            errors.fields["name"] = f"a tenant named {name!r} already exists"
            return None
        tenant, issued = actions.create_tenant(db, _actor(session), name, is_admin=is_admin, quotas=quotas)
        return tenant.id, issued

    try:
        created = await console.tx(work)
    except ConflictError:  # a concurrent create with the same name won the race
        errors.fields["name"] = f"a tenant named {name!r} already exists"
        created = None
    if created is None:
        context = await console.tx(lambda db: _tenants_context(request, db, session))
        return page(request, "tenants.html", {**context, "form": form, "errors": errors.fields}, 400)
    tenant_id, issued = created
    return page(request, "key_created.html", {"session": session, "tenant_id": tenant_id, "tenant_name": name,
                                              "key": issued.key, "prefix": issued.prefix, "active": "tenants"})


def _tenant_context(request: Request, db: Session, session: AdminSession, tenant_id: str) -> dict[str, Any] | None:
    row = get_tenant(db, TenantId(tenant_id))
    if row is None:
        return None
    offset = int_param(request, "key_offset", default=0, low=0, high=10_000_000)
    keys = queries.tenant_keys(db, tenant_id, queries.Page(console_of(request).page_size, offset))
    return {"session": session, "tenant": row, "keys": keys, "active": "tenants", "errors": {}, "form": {}}


def _not_found(request: Request, session: AdminSession) -> Response:
    return page(request, "error.html", {"session": session, "title": "Not found",
                                        "message": "No such tenant."}, 404)


@router.get("/tenants/{tenant_id}")
async def tenant_page(request: Request, session: Admin, tenant_id: str) -> Response:
    context = await console_of(request).tx(lambda db: _tenant_context(request, db, session, tenant_id))
    if context is None:
        return _not_found(request, session)
    return page(request, "tenant.html", context)


@router.post("/tenants/{tenant_id}/quotas")
async def set_quotas(request: Request, session: Admin, tenant_id: str) -> Response:
    form = dict(await request.form())
    check_csrf(request, session, form)
    errors = FormErrors({})
    quotas = parse_quotas(form, errors)

    def work(db: Session) -> dict[str, Any] | None | bool:
        row = get_tenant(db, TenantId(tenant_id))
        if row is None:
            return None
        if errors:
            return {**(_tenant_context(request, db, session, tenant_id) or {}), "errors": errors.fields,
                    "form": form}
        actions.set_quotas(db, _actor(session), row, quotas)
        return True

    return await _after(request, session, tenant_id, await console_of(request).tx(work))


@router.post("/tenants/{tenant_id}/status")
async def set_status(request: Request, session: Admin, tenant_id: str) -> Response:
    form = dict(await request.form())
    check_csrf(request, session, form)
    action = str(form.get("action") or "")

    def work(db: Session) -> dict[str, Any] | None | bool:
        row: TenantRow | None = get_tenant(db, TenantId(tenant_id))
        if row is None:
            return None
        problem = None
        if action not in ("disable", "enable"):
            problem = "must be disable or enable"
        elif action == "disable" and row.id == session.tenant_id:
            problem = "you cannot disable the tenant you are logged in as"
        if problem:
            return {**(_tenant_context(request, db, session, tenant_id) or {}), "errors": {"action": problem}}
        actions.set_disabled(db, _actor(session), TenantId(row.id), action == "disable")
        return True

    outcome = await console_of(request).tx(work)
    if outcome is True and action == "disable":  # after the commit: a gateway that looks again sees it
        await console_of(request).auth.announce(Invalidation(tenant_id))
    return await _after(request, session, tenant_id, outcome)


@router.post("/tenants/{tenant_id}/keys")
async def create_key(request: Request, session: Admin, tenant_id: str) -> Response:
    form = dict(await request.form())
    check_csrf(request, session, form)
    label = str(form.get("label") or "").strip() or None

    def work(db: Session) -> tuple[str, IssuedKey] | dict[str, Any] | None:
        row = get_tenant(db, TenantId(tenant_id))
        if row is None:
            return None
        if label is not None and len(label) > 200:
            return {**(_tenant_context(request, db, session, tenant_id) or {}),
                    "errors": {"label": "must be at most 200 characters"}, "form": form}
        return row.name, actions.create_key(db, _actor(session), TenantId(row.id), label=label)

    result = await console_of(request).tx(work)
    if result is None:
        return _not_found(request, session)
    if isinstance(result, dict):
        return page(request, "tenant.html", result, 400)
    name, issued = result
    return page(request, "key_created.html", {"session": session, "tenant_id": tenant_id, "tenant_name": name,
                                              "key": issued.key, "prefix": issued.prefix, "active": "tenants"})


@router.post("/tenants/{tenant_id}/keys/{key_id}/revoke")
async def revoke_key(request: Request, session: Admin, tenant_id: str, key_id: str) -> Response:
    form = dict(await request.form())
    check_csrf(request, session, form)
    if not key_id.isdigit() or len(key_id) > 12:
        raise BadParam("key_id", "must be a key's number")

    def work(db: Session) -> bool | None:
        if get_tenant(db, TenantId(tenant_id)) is None:
            return None
        return actions.revoke_key(db, _actor(session), TenantId(tenant_id), ApiKeyId(int(key_id)))

    revoked = await console_of(request).tx(work)
    if revoked:  # this key only: the tenant's other keys stay good (see `deploy.admin.revoke_keys`)
        await console_of(request).auth.announce(Invalidation(tenant_id, int(key_id)))
    return await _after(request, session, tenant_id, revoked)


async def _after(request: Request, session: AdminSession, tenant_id: str,
                 outcome: dict[str, Any] | None | bool) -> Response:
    """A change's answer: 404 for an unknown tenant, the form again with its errors, or back to the page."""
    if outcome is None:
        return _not_found(request, session)
    if isinstance(outcome, dict):
        return page(request, "tenant.html", outcome, 400)
    return redirect(f"/admin/tenants/{tenant_id}")
