"""`ServiceControlPlane`: the `ControlPlane` the gateway calls, composed of the parts that own each area.

    sessions ─ SessionOps        models ─ ModelOps (create, create-via-load, get_info)
    training ─ TrainingOps       sampling ─ SamplingOps (+ samplers: bindings, checkpoint loads)
    futures ─ FutureOps          catalog ─ CatalogOps (runs, checkpoints, downloads, usage)
    batch futures ─ BatchFutureOps (retrieve_futures, join_sampling_session)
    custom losses ─ CustomLossOps, stable_reinforce records ─ StabilityRecords
    weights ─ WeightsCopyOps (copy_weights, unload_model)   projects ─ ProjectOps (search, traces)
    JWTs ─ JwtAuth (auth/token)  admin ─ BillingOps (audit log, billing usage, storage)

All of them share one `ControlContext` (database, queue / results / notifier, checkpoint store, served
models). This class only routes calls; it also exposes the scheduler loops' counters (`runtime_stats`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import date, datetime
from pathlib import Path

from services.auth.tenants import Tenant
from services.control.api import (
    CheckpointKindName,
    CheckpointView,
    ControlError,
    FutureState,
    Invalid,
    ModelInfo,
    Page,
    RuntimeStats,
    SampleSubmitted,
    SaveOptions,
    SessionView,
    SignedUrls,
    Submitted,
    TrainingRunView,
)
from services.control.batch_futures import BatchFutureOps
from services.control.billing import BillingOps
from services.control.catalog import CatalogOps
from services.control.context import ControlContext, ControlOptions
from services.control.custom_losses import CustomLossOps
from services.control.futures import FutureOps
from services.control.jwt_tokens import JwtAuth, TokenSigner
from services.control.models import ModelOps
from services.control.projects import ProjectOps
from services.control.quota_standing import QuotaStanding
from services.control.quota_store import QuotaStore
from services.control.quotas import QuotaGate
from services.control.registry import ModelRegistry, ServedModel
from services.control.samplers import LoadLedger, SamplerBindings, SamplerDirectory
from services.control.sampling import SamplingOps
from services.control.sessions import SessionOps
from services.control.stability import StabilityRecords
from services.control.submission import OrderedSubmitter
from services.control.surface_views import (
    AuditView,
    BillingEventView,
    CompletionsPage,
    SessionSearch,
    SessionSummaryView,
    StorageUsageView,
    TraceExport,
)
from services.control.training import TrainingOps
from services.control.weights_copy import CopyDestination, WeightsCopyOps
from services.db.database import Database
from services.db.engine import is_sqlite
from services.db.group_commit import SQLITE_BEGIN, GroupCommitter, GroupStats
from services.db.ids import ModelId, RequestId, SamplingSessionId, SessionId
from services.domain.backend import BaseModelInfo
from services.domain.sampling import SampleWork
from services.domain.training import AdamParams, ForwardBackwardWork, LoraSpec
from services.jobqueue.protocol import Notifier, ResultStore, WorkQueue
from services.storage.protocol import CheckpointStore


class ServiceControlPlane:
    """Implements `services.control.api.ControlPlane` (and `RuntimeIntrospection`)."""

    def __init__(self, db: Database, queue: WorkQueue, results: ResultStore, notifier: Notifier,
                 store: CheckpointStore, models: ModelRegistry | Iterable[ServedModel],
                 options: ControlOptions | None = None, *, samplers: SamplerBindings | None = None,
                 loads: LoadLedger | None = None, quota_store: QuotaStore | None = None,
                 token_secret: bytes | None = None) -> None:
        """`samplers` / `loads` default to this process's memory; several gateways share Redis-backed ones.
        `quota_store` likewise (token buckets): default in-process, a `RedisQuotaStore` in cluster mode.
        `token_secret` signs JWTs and trace links (gateways that share it accept each other's tokens; None:
        a random secret of this process)."""
        registry = models if isinstance(models, ModelRegistry) else ModelRegistry(models)
        options = options or ControlOptions()
        quotas = QuotaGate(options.quotas, quota_store, default_max_models=options.default_max_models)
        self.ctx = ControlContext(db, queue, results, notifier, store, registry, options, quotas=quotas,
                                  writes=_group_committer(db, options))
        samplers = samplers or SamplerDirectory()
        self._sessions = SessionOps(self.ctx, options.heartbeat_write_s)
        self._models = ModelOps(self.ctx)
        self._training = TrainingOps(self.ctx, OrderedSubmitter(self.ctx), samplers)
        self._sampling = SamplingOps(self.ctx, samplers, loads)
        self._futures = FutureOps(self.ctx)
        self._catalog = CatalogOps(self.ctx)
        signer = TokenSigner(token_secret)
        self._jwt = JwtAuth(db, signer)
        self._batch = BatchFutureOps(self.ctx)
        self._custom = CustomLossOps(self.ctx)
        self._stability = StabilityRecords(self.ctx)
        self._projects = ProjectOps(self.ctx, signer)
        self._weights = WeightsCopyOps(self.ctx, OrderedSubmitter(self.ctx))
        self._billing = BillingOps(self.ctx)

    def close(self) -> None:
        """Finish the queued group-commit transactions and stop their writer thread (at shutdown)."""
        if self.ctx.writes is not None:
            self.ctx.writes.close()

    # -- sessions ---------------------------------------------------------------------------------
    async def create_session(self, tenant: Tenant, *, tags: list[str], user_metadata: dict[str, object],
                             sdk_version: str | None, project_id: str | None) -> SessionId:
        return await self._sessions.create_session(tenant, tags=tags, user_metadata=user_metadata,
                                                   sdk_version=sdk_version, project_id=project_id)

    async def heartbeat(self, tenant: Tenant, session_id: SessionId) -> None:
        await self._sessions.heartbeat(tenant, session_id)

    async def finish_session(self, tenant: Tenant, session_id: SessionId) -> None:
        await self._sessions.finish_session(tenant, session_id)

    # -- training ---------------------------------------------------------------------------------
    def base_models(self) -> list[BaseModelInfo]:
        return self.ctx.registry.infos()

    async def create_model(self, tenant: Tenant, session_id: SessionId, model_seq_id: int, base_model: str,
                           lora: LoraSpec, user_metadata: Mapping[str, object] | None) -> Submitted:
        return await self._models.create_model(tenant, session_id, model_seq_id, base_model, lora,
                                               user_metadata)

    async def get_info(self, tenant: Tenant, model_id: ModelId) -> ModelInfo:
        return await self._models.get_info(tenant, model_id)

    def model_known_owned(self, tenant: Tenant, model_id: ModelId) -> bool:
        return self._models.owned.known(tenant.id, model_id)

    async def forward_backward(self, tenant: Tenant, model_id: ModelId, seq_id: int,
                               work: ForwardBackwardWork) -> Submitted:
        try:
            work = await self._custom.attach(tenant, model_id, work)
            work = await self._stability.fill(tenant, work)
        except ControlError as exc:
            # Refused before the ordered submission: the seq id is consumed all the same (protocol §6.1).
            await self._training.reject_seq_id(tenant, model_id, seq_id, exc.message)
            raise
        return await self._training.forward_backward(tenant, model_id, seq_id, work)

    async def optim_step(self, tenant: Tenant, model_id: ModelId, seq_id: int,
                         params: AdamParams) -> Submitted:
        return await self._training.optim_step(tenant, model_id, seq_id, params)

    async def reject_seq_id(self, tenant: Tenant, model_id: ModelId, seq_id: int, error: str) -> None:
        await self._training.reject_seq_id(tenant, model_id, seq_id, error)

    async def save(self, tenant: Tenant, model_id: ModelId, seq_id: int, kind: CheckpointKindName,
                   options: SaveOptions, sampling_session_seq_id: int | None = None) -> Submitted:
        return await self._training.save(tenant, model_id, seq_id, kind, options, sampling_session_seq_id)

    async def load(self, tenant: Tenant, *, path: str, with_optimizer: bool, model_id: ModelId | None = None,
                   seq_id: int | None = None, session_id: SessionId | None = None,
                   model_seq_id: int | None = None) -> Submitted:
        if session_id is not None and model_seq_id is not None:
            return await self._models.create_from_checkpoint(tenant, session_id, model_seq_id, path,
                                                             with_optimizer)
        if model_id is not None and seq_id is not None:
            return await self._training.load_in_place(tenant, model_id, seq_id, path, with_optimizer)
        raise Invalid("load_weights needs session_id + model_seq_id (a new model) or model_id + seq_id",
                      field="model_id")

    # -- sampling ---------------------------------------------------------------------------------
    async def create_sampling_session(self, tenant: Tenant, session_id: SessionId, seq: int, *,
                                      model_path: str | None, base_model: str | None) -> SamplingSessionId:
        return await self._sampling.create_sampling_session(tenant, session_id, seq, model_path=model_path,
                                                            base_model=base_model)

    async def get_sampler(self, tenant: Tenant, sampler_id: SamplingSessionId) -> tuple[str, str | None]:
        return await self._sampling.get_sampler(tenant, sampler_id)

    async def sample(self, tenant: Tenant, sampler_id: SamplingSessionId, seq_id: int | None,
                     work: SampleWork) -> SampleSubmitted:
        return await self._sampling.sample(tenant, sampler_id, seq_id, work)

    # -- futures ----------------------------------------------------------------------------------
    async def retrieve(self, tenant: Tenant, request_id: RequestId, timeout_s: float) -> FutureState:
        return await self._futures.retrieve(tenant, request_id, timeout_s)

    async def cancel(self, tenant: Tenant, request_id: RequestId) -> None:
        await self._futures.cancel(tenant, request_id)

    # -- runs, sessions, checkpoints (REST) -------------------------------------------------------
    async def list_training_runs(self, tenant: Tenant, limit: int, offset: int,
                                 project_id: str | None = None) -> tuple[list[TrainingRunView], Page]:
        if project_id is not None:
            return await self._projects.project_runs(tenant, project_id, limit, offset)
        return await self._catalog.list_training_runs(tenant, limit, offset)

    async def get_training_run(self, tenant: Tenant, run_id: ModelId) -> TrainingRunView:
        return await self._catalog.get_training_run(tenant, run_id)

    async def list_sessions(self, tenant: Tenant, limit: int, offset: int) -> tuple[list[SessionId], Page]:
        return await self._sessions.list_sessions(tenant, limit, offset)

    async def get_session(self, tenant: Tenant, session_id: SessionId) -> SessionView:
        return await self._sessions.get_session(tenant, session_id)

    async def list_checkpoints(self, tenant: Tenant, run_id: ModelId | None, limit: int,
                               offset: int) -> tuple[list[CheckpointView], Page]:
        return await self._catalog.list_checkpoints(tenant, run_id, limit, offset)

    async def get_checkpoint(self, tenant: Tenant,
                             tinker_path: str) -> tuple[CheckpointView, TrainingRunView]:
        return await self._catalog.get_checkpoint(tenant, tinker_path)

    async def delete_checkpoint(self, tenant: Tenant, tinker_path: str) -> None:
        await self._catalog.delete_checkpoint(tenant, tinker_path)

    async def set_checkpoint_public(self, tenant: Tenant, tinker_path: str, public: bool) -> None:
        await self._catalog.set_checkpoint_public(tenant, tinker_path, public)

    async def set_checkpoint_ttl(self, tenant: Tenant, tinker_path: str, ttl_seconds: int | None) -> None:
        await self._catalog.set_checkpoint_ttl(tenant, tinker_path, ttl_seconds)

    async def external_weights_urls(self, tenant: Tenant, tinker_path: str, base_url: str) -> SignedUrls:
        return await self._catalog.external_weights_urls(tenant, tinker_path, base_url)

    async def open_signed_file(self, token: str) -> Path:
        return await self._catalog.open_signed_file(token)

    async def usage(self, tenant: Tenant) -> dict[str, float]:
        return await self._catalog.usage(tenant)

    # -- introspection ----------------------------------------------------------------------------
    def runtime_stats(self) -> list[RuntimeStats]:
        return self.ctx.registry.runtime_stats()

    def group_commit_stats(self) -> GroupStats | None:
        """The submissions' group committer's counters (None: group commit is off)."""
        return self.ctx.writes.stats if self.ctx.writes is not None else None

    def quota_standing(self, tenant: Tenant) -> QuotaStanding:
        """The tenant's token bucket and last quota refusal, from the limiter's own store (blocking: Redis)."""
        return self.ctx.quotas.standing(tenant)

    # -- the rest of the SDK surface ------------------------------------------------------------
    async def retrieve_futures(self, tenant: Tenant, sampling_id: SamplingSessionId, clone: int,
                               prev_cursor: int, timeout_s: float | None) -> CompletionsPage:
        return await self._batch.retrieve_futures(tenant, sampling_id, clone, prev_cursor, timeout_s)

    async def join_sampling_session(self, tenant: Tenant, sampling_id: SamplingSessionId) -> int:
        return await self._batch.join_sampling_session(tenant, sampling_id)

    async def create_custom_loss(self, tenant: Tenant, session_id: SessionId, seq: int, name: str,
                                 inputs: list[dict[str, object]], nodes: list[dict[str, object]]) -> Submitted:
        return await self._custom.create_custom_loss(tenant, session_id, seq, name, inputs, nodes)

    async def copy_weights(self, tenant: Tenant, source_path: str, *, session_id: SessionId | None,
                           model_seq_id: int | None, project_id: str | None, ttl_seconds: int | None,
                           source_owner: Tenant | None) -> str:
        destination = CopyDestination(session_id, model_seq_id, project_id)
        return await self._weights.copy_weights(tenant, source_path, destination, ttl_seconds, source_owner)

    async def unload_model(self, tenant: Tenant, model_id: ModelId) -> Submitted:
        return await self._weights.unload_model(tenant, model_id)

    async def assign_session_project(self, tenant: Tenant, session_id: SessionId, project_id: str) -> None:
        await self._projects.assign_session_project(tenant, session_id, project_id)

    async def search_sessions(self, tenant: Tenant, search: SessionSearch) -> list[SessionSummaryView]:
        return await self._projects.search_sessions(tenant, search)

    async def export_session_trace(self, tenant: Tenant, session_id: SessionId, base_url: str) -> TraceExport:
        return await self._projects.export_session_trace(tenant, session_id, base_url)

    async def session_trace(self, token: str) -> dict[str, object]:
        return await self._projects.session_trace(token)

    def mint_auth_token(self, tenant: Tenant) -> tuple[str, float]:
        return self._jwt.mint(tenant)

    async def authenticate_token(self, token: str) -> Tenant | None:
        return await self._jwt.authenticate(token)

    async def audit_log(self, tenant: Tenant, event_type: str, day: date | None) -> list[AuditView]:
        return await self._billing.audit_log(tenant, event_type, day)

    async def billing_usage(self, tenant: Tenant, starting_on: datetime,
                            ending_before: datetime) -> list[BillingEventView]:
        return await self._billing.billing_usage(tenant, starting_on, ending_before)

    async def checkpoint_storage(self, tenant: Tenant, project_id: str | None) -> list[StorageUsageView]:
        return await self._billing.checkpoint_storage(tenant, project_id)


def _group_committer(db: Database, options: ControlOptions) -> GroupCommitter | None:
    """The submissions' group committer, if `options.group_commit` (None: SQLite only) asks for one."""
    sqlite = is_sqlite(db.url)
    if not (sqlite if options.group_commit is None else options.group_commit):
        return None
    return GroupCommitter(db.sessions, begin_sql=SQLITE_BEGIN if sqlite else None)
