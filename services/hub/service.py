"""`HubPushService`: the tenant-facing side of hub pushes (what `/v1/hub_pushes` and `/v1/hub_credentials` call).

Creating a push checks everything that can be checked without the hub — the checkpoint is the caller's
(unknown and foreign paths give the same 404), the hub is known, the repo id is well formed, a token
exists (the tenant's or the operator's) — records it `queued` and hands its id to the dispatcher; the
request never waits for the hub. Tokens are encrypted before they reach the database and never read back
through this service.

Retrying puts a `failed` push back to `queued` and dispatches the same push id again (the same runner, or
the same Celery task in cluster mode); a push in any other state is refused with `NotRetryable`, naming it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import ControlError, Invalid, NotFound, Unavailable
from services.control.models import parse_path
from services.db import Database
from services.db.errors import NotFoundError
from services.db.hub_pushes import (
    count_hub_pushes,
    create_hub_push,
    delete_hub_credential,
    finish_hub_push,
    get_hub_credential,
    get_hub_push,
    list_hub_pushes,
    put_hub_credential,
    requeue_failed_hub_push,
)
from services.db.ids import HubPushId, TenantId
from services.db.models import HubPushRow, HubTarget
from services.hub.credentials import TokenCipher
from services.hub.dispatch import PushDispatcher
from services.hub.runner import HUB_NAMES

HUB_TARGETS_BY_NAME: dict[str, HubTarget] = {name: target for target, name in HUB_NAMES.items()}
# Both hubs: `namespace/name`, letters, digits, `-`, `_`, `.`; no `--`/`..`, no leading/trailing `-`/`.`.
_REPO_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^{_REPO_PART}/{_REPO_PART}$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,127}$")
MAX_TOKEN_CHARS = 4096
MAX_COMMIT_MESSAGE_CHARS = 2000
MAX_PAGE = 100


@dataclass(frozen=True)
class NewPush:
    tinker_path: str
    hub: str
    repo_id: str
    private: bool = True
    revision: str | None = None
    commit_message: str | None = None


@dataclass(frozen=True)
class PushView:
    id: int
    tinker_path: str
    hub: str
    repo_id: str
    private: bool
    revision: str | None
    status: str
    error: str | None
    attempts: int
    hub_revision: str | None
    url: str | None
    created_at: datetime
    finished_at: datetime | None


class NotRetryable(ControlError):
    """Only a failed push can be retried; `state` is the one it is in (answered 409 by the hub routes)."""

    status = 409

    def __init__(self, push_id: int, state: str) -> None:
        super().__init__(f"hub push {push_id} is {state}; only a failed push can be retried", field="status")
        self.state = state


RecordRetry = Callable[[Session, HubPushRow], None]
"""Writes the audit entry of an operator's retry, in the transaction that requeues the push."""


def hub_target(name: str) -> HubTarget:
    target = HUB_TARGETS_BY_NAME.get(name)
    if target is None:
        raise Invalid(f"unknown hub {name!r}: use one of {sorted(HUB_TARGETS_BY_NAME)}", field="hub")
    return target


class HubPushService:
    """Pushes and credentials of the calling tenant; `operator_hubs` are hubs with an operator-wide token."""

    def __init__(self, db: Database, cipher: TokenCipher, dispatcher: PushDispatcher, *,
                 operator_hubs: Mapping[HubTarget, bool] | None = None) -> None:
        self._db = db
        self._cipher = cipher
        self._dispatcher = dispatcher
        self._operator_hubs = {t for t, on in (operator_hubs or {}).items() if on}

    async def create(self, tenant: Tenant, new: NewPush) -> PushView:
        target = hub_target(new.hub)
        _check_push(new)
        parsed = parse_path(new.tinker_path, "tinker_path")
        view = await asyncio.to_thread(self._create_tx, TenantId(tenant.id), target, parsed.uri, new)
        await self._dispatch(view)
        return view

    async def get(self, tenant: Tenant, push_id: int) -> PushView:
        def tx() -> PushView | None:
            with self._db.sessions.begin() as db:
                row = get_hub_push(db, TenantId(tenant.id), HubPushId(push_id))
                return _view(row) if row is not None else None

        view = await asyncio.to_thread(tx)
        if view is None:
            raise NotFound(f"hub push {push_id} not found", field="push_id")
        return view

    async def list_pushes(self, tenant: Tenant, limit: int, offset: int) -> tuple[list[PushView], int]:
        if not 1 <= limit <= MAX_PAGE:
            raise Invalid(f"limit must be between 1 and {MAX_PAGE}, got {limit}", field="limit")
        if offset < 0:
            raise Invalid(f"offset must be >= 0, got {offset}", field="offset")

        def tx() -> tuple[list[PushView], int]:
            with self._db.sessions.begin() as db:
                rows = list_hub_pushes(db, TenantId(tenant.id), limit=limit, offset=offset)
                return [_view(r) for r in rows], count_hub_pushes(db, TenantId(tenant.id))

        return await asyncio.to_thread(tx)

    async def retry(self, tenant: Tenant, push_id: int) -> PushView:
        """Queue the tenant's failed push again; `NotFound` for unknown and foreign ids alike."""
        return await self._retry(HubPushId(push_id), TenantId(tenant.id), None)

    async def retry_any(self, push_id: int, record: RecordRetry) -> PushView:
        """Queue any tenant's failed push again (operators); `record` audits it in the same transaction."""
        return await self._retry(HubPushId(push_id), None, record)

    async def put_credential(self, tenant: Tenant, hub: str, token: str) -> None:
        target = hub_target(hub)
        token = token.strip()
        if not token or len(token) > MAX_TOKEN_CHARS or any(c.isspace() for c in token):
            raise Invalid(f"token must be 1 to {MAX_TOKEN_CHARS} characters without spaces", field="token")
        ciphertext = self._cipher.encrypt(token)

        def tx() -> None:
            with self._db.sessions.begin() as db:
                put_hub_credential(db, TenantId(tenant.id), target, ciphertext)

        await asyncio.to_thread(tx)

    async def delete_credential(self, tenant: Tenant, hub: str) -> None:
        target = hub_target(hub)

        def tx() -> bool:
            with self._db.sessions.begin() as db:
                return delete_hub_credential(db, TenantId(tenant.id), target)

        if not await asyncio.to_thread(tx):
            raise NotFound(f"no stored {hub} token", field="hub")

    # -- internals --------------------------------------------------------------------------------
    async def _retry(self, push_id: HubPushId, tenant_id: TenantId | None, record: RecordRetry | None) -> PushView:
        def tx() -> PushView:
            with self._db.sessions.begin() as db:
                found = requeue_failed_hub_push(db, push_id, tenant_id=tenant_id)
                if found is None:
                    raise NotFound(f"hub push {push_id} not found", field="push_id")
                row, before = found
                if before != "failed":
                    raise NotRetryable(push_id, before)
                if record is not None:
                    record(db, row)
                return _view(row)

        view = await asyncio.to_thread(tx)
        await self._dispatch(view)  # after commit: the runner must find the push queued
        return view

    async def _dispatch(self, view: PushView) -> None:
        """Hand the push over; if that fails (broker down) it is marked failed, retryable, and the caller gets 503."""
        try:
            self._dispatcher.dispatch(view.id)
        except Exception as exc:  # noqa: BLE001 - any broker failure: the push must not stay queued forever
            error = f"the push could not be queued ({type(exc).__name__}: {exc}); retry it later"

            def tx() -> None:
                with self._db.sessions.begin() as db:
                    finish_hub_push(db, HubPushId(view.id), "failed", error=error)

            await asyncio.to_thread(tx)
            raise Unavailable(f"hub push {view.id} could not be queued; retry it with "
                              f"POST /v1/hub_pushes/{view.id}/retry", field="hub") from exc

    def _create_tx(self, tenant_id: TenantId, target: HubTarget, uri: str, new: NewPush) -> PushView:
        with self._db.sessions.begin() as db:
            if target not in self._operator_hubs and get_hub_credential(db, tenant_id, target) is None:
                raise Invalid(f"no {new.hub} token to push with: store one first with PUT "
                              f'/v1/hub_credentials/{new.hub} {{"token": "..."}} (a write token of the repo '
                              "owner)", field="hub")
            try:
                row = create_hub_push(db, tenant_id, uri, target=target, repo=new.repo_id, private=new.private,
                                      revision=new.revision, commit_message=new.commit_message)
            except NotFoundError as exc:
                raise NotFound(f"checkpoint {uri} not found", field="tinker_path") from exc
            return _view(row)


def _check_push(new: NewPush) -> None:
    if not _REPO_ID.fullmatch(new.repo_id) or "--" in new.repo_id or ".." in new.repo_id:
        raise Invalid(f"repo_id {new.repo_id!r} must be namespace/name (letters, digits, '-', '_', '.'; "
                      "at most 96 characters each)", field="repo_id")
    if new.revision is not None and (not _REVISION.fullmatch(new.revision) or ".." in new.revision):
        raise Invalid(f"revision {new.revision!r} is not a valid branch name", field="revision")
    if new.commit_message is not None and not 1 <= len(new.commit_message) <= MAX_COMMIT_MESSAGE_CHARS:
        raise Invalid(f"commit_message must be 1 to {MAX_COMMIT_MESSAGE_CHARS} characters", field="commit_message")


def _view(row: HubPushRow) -> PushView:
    return PushView(id=row.id, tinker_path=row.tinker_path, hub=HUB_NAMES[row.target], repo_id=row.repo,
                    private=row.private, revision=row.revision, status=row.status, error=row.error,
                    attempts=row.attempts or 0, hub_revision=row.hub_revision, url=row.url,
                    created_at=row.created_at, finished_at=row.finished_at)
