"""Creating training models (Tinker's `create_model` and create-via-`load_weights`) and describing them.

A model is a training run row plus an adapter on its base model's worker. Both ways of creating one are
the model's seq 0: the run row and the seq-0 request row are written in one transaction (so a retry finds
both and gets the same request id), then a `CREATE` or `LOAD` command goes on the queue. Creating checks
the base model is served, the LoRA spec fits it, the session is the tenant's and the tenant's model quota;
loading accepts only the tenant's own checkpoints or published ones and takes the LoRA spec from the run
that saved the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import Conflict, Invalid, ModelInfo, NotFound, Submitted
from services.control.context import ControlContext, not_found, request_for_seq
from services.control.ownership import OwnedIds
from services.control.registry import ServedModel
from services.db.checkpoints import get_readable_checkpoint
from services.db.errors import NotFoundError
from services.db.ids import ModelId, RequestId, SessionId, TenantId, training_run_id
from services.db.models import CheckpointRow, TrainingRunRow
from services.db.request_log import record_request
from services.db.runs import create_training_run, get_training_run, reserve_seq_id
from services.domain.training import AdapterId, LoraSpec
from services.runtime.commands import CreateAdapter, Load
from services.scheduler.requests import RequestKind
from services.wire.errors import WireError
from services.wire.paths import TinkerPath, parse_tinker_path


def lora_config_of(spec: LoraSpec) -> dict[str, Any]:
    """How a LoRA spec is stored on the run row."""
    return asdict(spec)


def lora_spec_of(run: TrainingRunRow) -> LoraSpec:
    """The run's LoRA spec (unknown keys ignored, missing ones defaulted; the rank column wins)."""
    known = {f.name for f in fields(LoraSpec)}
    config = {k: v for k, v in (run.lora_config or {}).items() if k in known}
    config["rank"] = run.lora_rank
    return LoraSpec(**config)


def parse_path(path: str, field: str = "path") -> TinkerPath:
    try:
        return parse_tinker_path(path, field)
    except WireError as exc:
        raise Invalid(exc.message, field=exc.field) from exc


@dataclass(frozen=True)
class _NewRun:
    """What creating a run at seq 0 needs."""

    tenant: Tenant
    session_id: SessionId
    model_seq_id: int
    kind_name: str
    base_model: str
    lora: LoraSpec
    user_metadata: Mapping[str, object] | None = None


class ModelOps:
    def __init__(self, ctx: ControlContext) -> None:
        self._ctx = ctx
        self.owned = OwnedIds()
        """Models `get_info` found to be their tenant's (spares the edge's per-step ownership lookups)."""

    async def create_model(self, tenant: Tenant, session_id: SessionId, model_seq_id: int, base_model: str,
                           lora: LoraSpec, user_metadata: Mapping[str, object] | None) -> Submitted:
        served = self._ctx.registry.require(base_model)
        _check_lora(lora, served)
        new = _NewRun(tenant, session_id, model_seq_id, "create_model", base_model, lora, user_metadata)
        model_id, request_id, dispatch = await self._ctx.tx(lambda db: self._create_run_tx(db, new))
        if dispatch:
            command = CreateAdapter(model_id, AdapterId(model_id), lora)
            self._ctx.enqueue(served, tenant, request_id, model_id, RequestKind.CREATE, 0, payload=command)
        return Submitted(request_id, model_id)

    async def create_from_checkpoint(self, tenant: Tenant, session_id: SessionId, model_seq_id: int,
                                     path: str, with_optimizer: bool) -> Submitted:
        """load_weights with session_id + model_seq_id: a new model whose seq 0 loads the checkpoint."""
        parsed = parse_path(path)

        def tx(db: Session) -> tuple[ModelId, RequestId, bool, CheckpointRow, ServedModel]:
            checkpoint, source = readable_checkpoint(db, tenant, parsed)
            _check_optimizer(checkpoint, with_optimizer)
            served = self._ctx.registry.require(source.base_model, field="path")
            new = _NewRun(tenant, session_id, model_seq_id, "load_weights", source.base_model,
                          lora_spec_of(source))
            return (*self._create_run_tx(db, new), checkpoint, served)

        model_id, request_id, dispatch, checkpoint, served = await self._ctx.tx(tx)
        if dispatch:
            command = Load(AdapterId(model_id), self._ctx.store.local_path(checkpoint.storage_uri),
                           with_optimizer, model_id, parsed.uri, self._ctx.store.remote)
            self._ctx.enqueue(served, tenant, request_id, model_id, RequestKind.LOAD, 0, payload=command)
        return Submitted(request_id, model_id)

    async def get_info(self, tenant: Tenant, model_id: ModelId) -> ModelInfo:
        run = await self._ctx.tx(lambda db: get_training_run(db, TenantId(tenant.id), model_id))
        if run is None:
            raise NotFound(not_found("model", model_id), field="model_id")
        self.owned.remember(tenant.id, model_id)
        served = self._ctx.registry.for_run(run.base_model)
        return ModelInfo(model_id=run.id, base=served.info, lora=lora_spec_of(run))

    def _create_run_tx(self, db: Session, new: _NewRun) -> tuple[ModelId, RequestId, bool]:
        """The run and its seq-0 request, and whether to queue that request: a new one, or a retry's of one
        still `queued` (the first attempt's process may have died between commit and queueing; the
        scheduler drops a copy of a request it already has)."""
        tenant_id = TenantId(new.tenant.id)
        model_id = training_run_id(new.session_id, new.model_seq_id)
        if get_training_run(db, tenant_id, model_id) is None:
            self._check_quota(db, new.tenant)
            self._insert_run(db, new)
        existing = request_for_seq(db, model_id, 0)
        if existing is not None:
            if existing.kind != new.kind_name:
                raise Conflict(f"model {model_id} was already created by a {existing.kind} request",
                               field="model_seq_id")
            return model_id, existing.id, existing.status == "queued"
        row = record_request(db, tenant_id, new.kind_name, model_id=model_id, seq_id=0, now=self._ctx.clock())
        reserve_seq_id(db, tenant_id, model_id, 0, now=self._ctx.clock())
        return model_id, row.id, True

    def _insert_run(self, db: Session, new: _NewRun) -> None:
        if new.model_seq_id < 0:
            raise Invalid(f"model_seq_id must be >= 0, got {new.model_seq_id}", field="model_seq_id")
        try:
            create_training_run(
                db, TenantId(new.tenant.id), new.session_id, new.model_seq_id, base_model=new.base_model,
                lora_rank=new.lora.rank, lora_config=lora_config_of(new.lora),
                user_metadata=dict(new.user_metadata or {}), now=self._ctx.clock(),
            )
        except NotFoundError as exc:
            raise NotFound(not_found("session", new.session_id), field="session_id") from exc

    def _check_quota(self, db: Session, tenant: Tenant) -> None:
        """Model and concurrency quotas (see `quotas`); a refusal raises before anything is written."""
        self._ctx.quotas.check_models(db, tenant)
        self._ctx.quotas.check_concurrency(db, tenant)


def readable_checkpoint(db: Session, tenant: Tenant,
                        path: TinkerPath) -> tuple[CheckpointRow, TrainingRunRow]:
    """A checkpoint the tenant may load (its own or a published, unexpired one) and the run that saved it."""
    checkpoint = get_readable_checkpoint(db, TenantId(tenant.id), path.uri)
    source = None
    if checkpoint is not None:
        # The owner's run: for a published checkpoint that is another tenant's, read only for its config.
        source = get_training_run(db, TenantId(checkpoint.tenant_id), checkpoint.training_run_id)
    if checkpoint is None or source is None:
        raise NotFound(not_found("checkpoint", path.uri), field="path")
    return checkpoint, source


def _check_optimizer(checkpoint: CheckpointRow, with_optimizer: bool) -> None:
    if with_optimizer and checkpoint.kind != "training":
        raise Invalid(f"checkpoint {checkpoint.tinker_path} holds weights only; optimizer state is saved "
                      "by save_state (tinker://.../weights/...)", field="path")


def _check_lora(lora: LoraSpec, served: ServedModel) -> None:
    if lora.rank > served.max_lora_rank:
        raise Invalid(f"rank {lora.rank} exceeds the maximum of {served.max_lora_rank} for {served.name}",
                      field="lora_config.rank")
