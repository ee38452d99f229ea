"""`ServiceControlPlane`: the `ControlPlane` the gateway calls, composed of the parts that own each area.

    sessions ─ SessionOps        models ─ ModelOps (create, create-via-load, get_info)
    training ─ TrainingOps       sampling ─ SamplingOps (+ samplers: bindings, checkpoint loads)
    futures ─ FutureOps          catalog ─ CatalogOps (runs, checkpoints, downloads, usage)

All of them share one `ControlContext` (database, queue / results / notifier, checkpoint store, served
models). This class only routes calls; it also exposes the scheduler loops' counters (`runtime_stats`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from services.auth.tenants import Tenant
from services.control.api import (
    CheckpointKindName,
    CheckpointView,
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
from services.control.catalog import CatalogOps
from services.control.context import ControlContext, ControlOptions
from services.control.futures import FutureOps
from services.control.models import ModelOps
from services.control.quotas import QuotaGate, QuotaStore
from services.control.registry import ModelRegistry, ServedModel
from services.control.samplers import LoadLedger, SamplerBindings, SamplerDirectory
from services.control.sampling import SamplingOps
from services.control.sessions import SessionOps
from services.control.submission import OrderedSubmitter
from services.control.training import TrainingOps
from services.db.database import Database
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
                 loads: LoadLedger | None = None, quota_store: QuotaStore | None = None) -> None:
        """`samplers` / `loads` default to this process's memory; several gateways share Redis-backed ones.
        `quota_store` likewise (token buckets): default in-process, a `RedisQuotaStore` in cluster mode."""
        registry = models if isinstance(models, ModelRegistry) else ModelRegistry(models)
        options = options or ControlOptions()
        quotas = QuotaGate(options.quotas, quota_store, default_max_models=options.default_max_models)
        self.ctx = ControlContext(db, queue, results, notifier, store, registry, options, quotas=quotas)
        samplers = samplers or SamplerDirectory()
        self._sessions = SessionOps(self.ctx)
        self._models = ModelOps(self.ctx)
        self._training = TrainingOps(self.ctx, OrderedSubmitter(self.ctx), samplers)
        self._sampling = SamplingOps(self.ctx, samplers, loads)
        self._futures = FutureOps(self.ctx)
        self._catalog = CatalogOps(self.ctx)

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

    async def forward_backward(self, tenant: Tenant, model_id: ModelId, seq_id: int,
                               work: ForwardBackwardWork) -> Submitted:
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
    async def list_training_runs(self, tenant: Tenant, limit: int,
                                 offset: int) -> tuple[list[TrainingRunView], Page]:
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
