"""`copy_weights` (a checkpoint copied into a run of the caller's) and `unload_model`.

Who may copy what, as the SDK models it: a tenant copies its own checkpoints and published ones; another
tenant's unpublished checkpoint only with a `weights_access_token` — an API key of the owning tenant, which
the gateway authenticates and passes on as `source_owner`. Without one, a foreign checkpoint is "not found"
exactly like an unknown path (tenants never learn what others have). The copy lands in the training run
`{session_id}:train:{model_seq_id}` (created, unloaded, with the source run's base model and LoRA shape), or —
given a `destination_project_id` — in a new session of that project; the files are copied, so the copy
outlives the source. Load it like any checkpoint (`create_training_client_from_state`, sampling clients).

`unload_model` frees a model's adapter on the worker after everything queued before it (an ordered barrier at
the model's next seq id) and marks the run `unloaded`; its checkpoints stay.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import Invalid, ModelCreated, NotFound, Submitted
from services.control.billing import audit
from services.control.context import ControlContext, not_found
from services.control.models import parse_path, readable_checkpoint
from services.control.registry import ServedModel
from services.control.submission import OrderedCall, OrderedSubmitter, Prepared
from services.db.checkpoints import create_checkpoint, get_checkpoint
from services.db.errors import ConflictError
from services.db.ids import ModelId, SessionId, TenantId, training_run_id
from services.db.models import CheckpointRow, TrainingRunRow
from services.db.runs import RunFacts, create_training_run, get_training_run, set_training_run_status
from services.db.sessions import create_session
from services.domain.backend import Backend
from services.domain.training import AdapterId
from services.scheduler.requests import RequestKind
from services.storage.protocol import StorageError
from services.wire.paths import TYPE_TO_SEGMENT, checkpoint_path

MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 24 * 3600


@dataclass(frozen=True)
class CopyDestination:
    session_id: SessionId | None = None
    model_seq_id: int | None = None
    project_id: str | None = None


@dataclass(frozen=True)
class DropAdapter:
    """`unload_model`'s barrier: free the adapter's slot on the worker."""

    model_id: ModelId
    adapter_id: AdapterId

    def run(self, backend: Backend) -> object:
        backend.drop_adapter(self.adapter_id)
        return ModelCreated(self.model_id)


class WeightsCopyOps:
    def __init__(self, ctx: ControlContext, submitter: OrderedSubmitter) -> None:
        self._ctx = ctx
        self._submitter = submitter

    async def copy_weights(self, tenant: Tenant, source_path: str, destination: CopyDestination,
                           ttl_seconds: int | None, source_owner: Tenant | None) -> str:
        parsed = parse_path(source_path, "source_path")
        if ttl_seconds is not None and not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
            raise Invalid(f"must be between {MIN_TTL_S} and {MAX_TTL_S} seconds", field="ttl_seconds")

        def tx(db: Session) -> tuple[str, str, str]:
            reader = source_owner if source_owner is not None else tenant
            try:
                source, run = readable_checkpoint(db, reader, parsed)
            except NotFound:
                hint = "" if source_owner else " (another tenant's checkpoint needs weights_access_token)"
                raise NotFound(not_found("checkpoint", parsed.uri) + hint, field="source_path") from None
            if source_owner is not None and source.tenant_id != source_owner.id:
                raise NotFound("weights_access_token does not belong to the owner of source_path",
                               field="weights_access_token")
            target_run = self._target_run(db, tenant, destination, run)
            copied = self._copy_row(db, tenant, source, target_run, parsed.name, ttl_seconds)
            audit(db, tenant, action="copied", target_type="checkpoint", target_id=copied[2],
                  detail={"source": parsed.uri, "source_tenant": source.tenant_id})
            return copied

        src_uri, dst_uri, path = await self._ctx.tx(tx)
        try:  # through the store: with S3 the files are objects, copied server-side
            await asyncio.to_thread(self._ctx.store.copy_checkpoint, src_uri, dst_uri)
        except StorageError as exc:
            await self._ctx.tx(lambda db: _drop_row(db, tenant, path))
            raise NotFound(f"checkpoint {source_path} has no stored files", field="source_path") from exc
        return path

    def _target_run(self, db: Session, tenant: Tenant, dest: CopyDestination,
                    source_run: TrainingRunRow) -> TrainingRunRow:
        tenant_id = TenantId(tenant.id)
        session_id, seq = dest.session_id, dest.model_seq_id
        if session_id is None:
            session = create_session(db, tenant_id, tags=["copy_weights"], user_metadata={}, sdk_version=None,
                                     project_id=dest.project_id, now=self._ctx.clock())
            session_id, seq = SessionId(session.id), 0
        assert seq is not None
        existing = get_training_run(db, tenant_id, training_run_id(session_id, seq))
        if existing is not None:
            if existing.base_model != source_run.base_model:
                raise Invalid(f"run {existing.id} trains {existing.base_model}, the source {source_run.base_model}",
                              field="model_seq_id")
            return existing
        try:
            run = create_training_run(db, tenant_id, session_id, seq, base_model=source_run.base_model,
                                      lora_rank=source_run.lora_rank, lora_config=dict(source_run.lora_config),
                                      now=self._ctx.clock())
        except Exception as exc:  # NotFoundError: the session is not the caller's
            raise NotFound(not_found("session", session_id), field="session_id") from exc
        set_training_run_status(db, tenant_id, ModelId(run.id), "unloaded")
        return run

    def _copy_row(self, db: Session, tenant: Tenant, source: CheckpointRow, run: TrainingRunRow, name: str,
                  ttl_seconds: int | None) -> tuple[str, str, str]:
        segment = TYPE_TO_SEGMENT[source.kind]
        path = checkpoint_path(run.id, source.kind, name)
        uri = self._ctx.store.uri_for(tenant.id, run.id, source.kind, name)
        expires = self._ctx.clock() + timedelta(seconds=ttl_seconds) if ttl_seconds else None
        try:
            create_checkpoint(db, TenantId(tenant.id), ModelId(run.id), f"{segment}/{name}", kind=source.kind,
                              tinker_path=path, storage_uri=uri, size_bytes=source.size_bytes, expires_at=expires,
                              user_metadata=dict(source.user_metadata or {}), now=self._ctx.clock())
        except ConflictError as exc:
            raise Invalid(f"{path} already exists; copy into another model slot", field="model_seq_id") from exc
        return source.storage_uri, uri, path

    async def unload_model(self, tenant: Tenant, model_id: ModelId) -> Submitted:
        run = await self._ctx.tx(lambda db: get_training_run(db, TenantId(tenant.id), model_id))
        if run is None:
            raise NotFound(not_found("model", model_id), field="model_id")

        def prepare(db: Session, _run: RunFacts, _served: ServedModel) -> Prepared:
            set_training_run_status(db, TenantId(tenant.id), model_id, "unloaded")
            return Prepared(RequestKind.SAVE, DropAdapter(model_id, AdapterId(model_id)))

        return await self._submitter.submit(OrderedCall(tenant, model_id, max(1, run.next_seq_id), "unload_model",
                                                        prepare))


def _drop_row(db: Session, tenant: Tenant, path: str) -> None:
    row = get_checkpoint(db, TenantId(tenant.id), path)
    if row is not None:
        db.delete(row)
