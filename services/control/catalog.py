"""Training runs and checkpoints as the REST API shows them: listing, details, deletion, publishing,
TTLs, download URLs for exported weights, the tenant's usage totals, and the rows → views mapping.

Reads are scoped to the tenant, except that a published, unexpired checkpoint (and the run that saved it)
is readable by anyone (`get_checkpoint`, `external_weights_urls`); changes are owner-only. Deleting a
checkpoint removes its row first and then its files, so a failure to delete files never leaves a row that
points at nothing.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import CheckpointView, Invalid, NotFound, Page, SignedUrls, TrainingRunView
from services.control.context import ControlContext, count_checkpoints, count_training_runs, not_found
from services.control.models import lora_spec_of, parse_path, readable_checkpoint
from services.control.quotas import count_tenant_checkpoints
from services.control.samplers import checkpoint_version
from services.db.audit import record_audit
from services.db.checkpoints import (
    checkpoint_storage_bytes,
    delete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    list_checkpoints_for_run,
    set_checkpoint_expiry,
    set_checkpoint_public,
)
from services.db.ids import ModelId, TenantId
from services.db.models import CheckpointRow, TrainingRunRow
from services.db.runs import get_training_run, list_training_runs
from services.db.usage import usage_totals
from services.storage.protocol import InvalidToken, StorageError
from services.storage.signing import token_version

_ALL_TIME = datetime(1970, 1, 1, tzinfo=UTC)


class CatalogOps:
    def __init__(self, ctx: ControlContext) -> None:
        self._ctx = ctx

    # -- runs -------------------------------------------------------------------------------------
    async def list_training_runs(self, tenant: Tenant, limit: int,
                                 offset: int) -> tuple[list[TrainingRunView], Page]:
        def tx(db: Session) -> tuple[list[TrainingRunView], int]:
            rows = list_training_runs(db, TenantId(tenant.id), limit=limit, offset=offset)
            return [run_view(db, r) for r in rows], count_training_runs(db, TenantId(tenant.id))

        views, total = await self._ctx.tx(tx)
        return views, Page(offset=offset, limit=limit, total_count=total)

    async def get_training_run(self, tenant: Tenant, run_id: ModelId) -> TrainingRunView:
        def tx(db: Session) -> TrainingRunView:
            row = get_training_run(db, TenantId(tenant.id), run_id)
            if row is None:
                raise NotFound(not_found("training run", run_id), field="training_run_id")
            return run_view(db, row)

        return await self._ctx.tx(tx)

    # -- checkpoints ------------------------------------------------------------------------------
    async def list_checkpoints(self, tenant: Tenant, run_id: ModelId | None, limit: int,
                               offset: int) -> tuple[list[CheckpointView], Page]:
        tenant_id = TenantId(tenant.id)

        def tx(db: Session) -> tuple[list[CheckpointView], int]:
            if run_id is None:
                rows = list_checkpoints(db, tenant_id, limit=limit, offset=offset)
            elif get_training_run(db, tenant_id, run_id) is None:
                raise NotFound(not_found("training run", run_id), field="training_run_id")
            else:
                rows = list_checkpoints_for_run(db, tenant_id, run_id, limit=limit, offset=offset)
            return [checkpoint_view(r) for r in rows], count_checkpoints(db, tenant_id, run_id)

        views, total = await self._ctx.tx(tx)
        return views, Page(offset=offset, limit=limit, total_count=total)

    async def get_checkpoint(self, tenant: Tenant,
                             tinker_path: str) -> tuple[CheckpointView, TrainingRunView]:
        parsed = parse_path(tinker_path)

        def tx(db: Session) -> tuple[CheckpointView, TrainingRunView]:
            checkpoint, run = readable_checkpoint(db, tenant, parsed)
            return checkpoint_view(checkpoint), run_view(db, run)

        return await self._ctx.tx(tx)

    async def delete_checkpoint(self, tenant: Tenant, tinker_path: str) -> None:
        parsed = parse_path(tinker_path)

        def tx(db: Session) -> CheckpointRow | None:
            deleted = delete_checkpoint(db, TenantId(tenant.id), parsed.uri)
            if deleted is not None:  # the operators' audit log records deletions (same transaction)
                record_audit(db, action="checkpoint.delete", target_type="checkpoint", target_id=parsed.uri,
                             actor_tenant_id=tenant.id, actor_key_prefix=None, tenant_id=tenant.id,
                             detail={"size_bytes": deleted.size_bytes})
            return deleted

        row = await self._ctx.tx(tx)
        if row is None:
            raise NotFound(not_found("checkpoint", parsed.uri), field="path")
        self._ctx.store.delete(row.storage_uri)

    async def set_checkpoint_public(self, tenant: Tenant, tinker_path: str, public: bool) -> None:
        parsed = parse_path(tinker_path)
        changed = await self._ctx.tx(
            lambda db: set_checkpoint_public(db, TenantId(tenant.id), parsed.uri, public)
        )
        if not changed:
            raise NotFound(not_found("checkpoint", parsed.uri), field="path")

    async def set_checkpoint_ttl(self, tenant: Tenant, tinker_path: str, ttl_seconds: int | None) -> None:
        parsed = parse_path(tinker_path)
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise Invalid(f"ttl_seconds must be positive or null, got {ttl_seconds}", field="ttl_seconds")
        expires_at = None if ttl_seconds is None else self._ctx.clock() + timedelta(seconds=ttl_seconds)
        if not await self._ctx.tx(lambda db: set_checkpoint_expiry(db, TenantId(tenant.id), parsed.uri,
                                                                   expires_at)):
            raise NotFound(not_found("checkpoint", parsed.uri), field="path")

    # -- downloads --------------------------------------------------------------------------------
    async def external_weights_urls(self, tenant: Tenant, tinker_path: str, base_url: str) -> SignedUrls:
        parsed = parse_path(tinker_path)
        if parsed.checkpoint_type != "external":
            raise Invalid("only external_weights checkpoints can be downloaded; export with "
                          "save_weights_external first", field="path")
        checkpoint, _ = await self._ctx.tx(lambda db: readable_checkpoint(db, tenant, parsed))
        expires = self._ctx.clock() + timedelta(seconds=self._ctx.options.download_url_ttl_s)
        try:
            # Bound to the row: after a delete and a new save under the same name the links stop working.
            urls = self._ctx.store.download_urls(checkpoint.storage_uri, base_url, expires,
                                                 version=checkpoint_version(checkpoint.id, checkpoint.created_at))
        except StorageError as exc:
            raise NotFound(not_found("checkpoint", parsed.uri), field="path") from exc
        return SignedUrls(urls=urls, expires=expires)

    async def open_signed_file(self, token: str) -> Path:
        opener = getattr(self._ctx.store, "open_signed", None)
        if opener is None:
            raise NotFound("downloads are not served by this server's checkpoint store")
        try:
            path = Path(opener(token))
            version = token_version(token)
        except (InvalidToken, StorageError) as exc:
            raise NotFound(f"download link is invalid or expired: {exc}") from exc
        if version is not None and not await self._ctx.tx(lambda db: self._still_signed_row(db, version, path)):
            raise NotFound("download link is invalid or expired: its checkpoint was deleted or replaced")
        return path

    def _still_signed_row(self, db: Session, version: str, path: Path) -> bool:
        """Whether the checkpoint version a token was signed for still exists, unexpired, and holds `path`."""
        row_id = version.partition(".")[0]
        row = db.get(CheckpointRow, int(row_id)) if row_id.isdigit() else None
        if row is None or checkpoint_version(row.id, row.created_at) != version:
            return False
        if row.expires_at is not None and row.expires_at <= self._ctx.clock():
            return False
        return path.is_relative_to(self._ctx.store.local_path(row.storage_uri).resolve())

    # -- usage ------------------------------------------------------------------------------------
    async def usage(self, tenant: Tenant) -> dict[str, float]:
        def tx(db: Session) -> dict[str, float]:
            out: dict[str, float] = {}
            for kind, total in usage_totals(db, TenantId(tenant.id), since=_ALL_TIME).items():
                out[f"{kind}_tokens"] = float(total.tokens)
                out[f"{kind}_requests"] = float(total.requests)
            out["checkpoint_bytes"] = float(checkpoint_storage_bytes(db, TenantId(tenant.id)))
            out["checkpoints"] = float(count_tenant_checkpoints(db, TenantId(tenant.id)))
            # The storage quotas in force (absent: unlimited), so a tenant sees how close it is.
            for name, limit in self._ctx.quotas.storage_limits(tenant).items():
                if limit is not None:
                    out[name] = float(limit)
            return out

        return await self._ctx.tx(tx)


# -- rows as views ------------------------------------------------------------------------------
def checkpoint_view(row: CheckpointRow) -> CheckpointView:
    return CheckpointView(
        checkpoint_id=row.checkpoint_id,
        kind=row.kind,
        tinker_path=row.tinker_path,
        created_at=row.created_at,
        size_bytes=row.size_bytes,
        public=row.public,
        expires_at=row.expires_at,
        user_metadata=_strings(row.user_metadata),
    )


def run_view(db: Session, row: TrainingRunRow) -> TrainingRunView:
    """The run with its latest training and sampler checkpoints (read with the run owner's id)."""
    owner = TenantId(row.tenant_id)
    last = latest_checkpoint(db, owner, ModelId(row.id), "training")
    last_sampler = latest_checkpoint(db, owner, ModelId(row.id), "sampler")
    return TrainingRunView(
        training_run_id=ModelId(row.id),
        base_model=row.base_model,
        model_owner=row.tenant_id,
        lora=lora_spec_of(row),
        last_request_time=row.last_request_at or row.created_at,
        corrupted=row.status == "corrupted",
        last_checkpoint=checkpoint_view(last) if last is not None else None,
        last_sampler_checkpoint=checkpoint_view(last_sampler) if last_sampler is not None else None,
        user_metadata=_strings(row.user_metadata),
    )


def _strings(metadata: dict[str, object] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (metadata or {}).items()}
