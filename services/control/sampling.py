"""Sampling sessions and sample requests.

`create_sampling_session` binds `{session}:sample:{k}` to a checkpoint (loaded into a shared frozen
adapter before it returns, so the first sample never waits for weights) or to the bare base model.
`sample` validates the prompt against the base model's limits, dedupes `(sampling_session_id, seq_id)`
against the request log, and queues an unordered `SAMPLE` request; its promise carries one
`sample_sequence_id` per requested sample.

A submission reads its sampling session once per process: the fields it needs (`SamplerFacts`) never change
after the row is created and the row is never deleted, so they are kept per (tenant, session) in an
`OwnedFacts`. Only a lookup that found the caller's own session fills it: a foreign or unknown id is looked
up on every submission and answered 404 exactly as before. What can change about a session (its checkpoint
deleted, unpublished or replaced) is checked by `_check_still_readable`, as before, not remembered here.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, replace

from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import Invalid, NotFound, SampleSubmitted
from services.control.context import ControlContext, ephemeral_save_for, not_found, sample_request_for_seq
from services.control.models import parse_path, readable_checkpoint
from services.control.ownership import OwnedFacts
from services.control.registry import ServedModel
from services.control.samplers import (
    BindingCheck,
    CheckpointLoader,
    CheckpointToLoad,
    LoadLedger,
    SamplerBinding,
    SamplerBindings,
    bound_checkpoint_version,
    checkpoint_version,
)
from services.db.errors import NotFoundError
from services.db.ids import RequestId, SamplingSessionId, SessionId, TenantId
from services.db.models import SamplingSessionRow
from services.db.request_log import record_request
from services.db.runs import create_sampling_session, get_sampling_session
from services.db.sdk_surface import mark_stability_recorded
from services.db.sessions import get_session
from services.domain.sampling import SampleWork
from services.domain.validation import InvalidWork, validate_sample
from services.runtime.commands import Sample
from services.scheduler.requests import RequestKind
from services.wire.paths import sample_sequence_ids

# Retries of one (sampling session, seq_id) are serialised so that both find one request row; striped
# locks keep that bounded without a lock per session.
_LOCK_STRIPES = 64


@dataclass(frozen=True)
class SamplerFacts:
    """What a submission reads of its sampling session row: fixed when the row is created (only
    `joined_clients` ever changes, which sampling does not read)."""

    id: SamplingSessionId
    session_id: SessionId
    base_model: str
    model_path: str | None

    @classmethod
    def of(cls, row: SamplingSessionRow) -> SamplerFacts:
        return cls(SamplingSessionId(row.id), SessionId(row.session_id), row.base_model, row.model_path)


class SamplingOps:
    def __init__(self, ctx: ControlContext, samplers: SamplerBindings, loads: LoadLedger | None = None) -> None:
        self._ctx = ctx
        self._samplers = samplers
        self._loader = CheckpointLoader(ctx, loads)
        self._binding_check = BindingCheck(ctx.options.sampler_recheck_s)
        self._stripes = [asyncio.Lock() for _ in range(_LOCK_STRIPES)]
        self._sessions: OwnedFacts[SamplerFacts] = OwnedFacts()
        """Sampling sessions a submission found to be their tenant's: every sample reads one."""

    async def create_sampling_session(self, tenant: Tenant, session_id: SessionId, seq: int, *,
                                      model_path: str | None, base_model: str | None) -> SamplingSessionId:
        if seq < 0:
            raise Invalid(f"sampling_session_seq_id must be >= 0, got {seq}", field="sampling_session_seq_id")
        if model_path is not None:
            binding = await self._bind_checkpoint(tenant, session_id, model_path, base_model)
        elif base_model is not None:
            binding = SamplerBinding(self._ctx.registry.require(base_model).name, None)
        else:
            raise Invalid("create_sampling_session needs a model_path or a base_model", field="model_path")

        def tx(db: Session) -> SamplingSessionRow:
            self._ctx.quotas.check_sampling_sessions(db, tenant)
            try:
                return create_sampling_session(db, TenantId(tenant.id), session_id, seq,
                                               base_model=binding.base_model, model_path=model_path,
                                               now=self._ctx.clock())
            except NotFoundError as exc:
                raise NotFound(not_found("session", session_id), field="session_id") from exc

        row = await self._ctx.tx(tx)
        self._samplers.bind(SamplingSessionId(row.id), binding)
        return SamplingSessionId(row.id)

    async def get_sampler(self, tenant: Tenant, sampler_id: SamplingSessionId) -> tuple[str, str | None]:
        row = await self._ctx.tx(lambda db: get_sampling_session(db, TenantId(tenant.id), sampler_id))
        if row is None:
            raise NotFound(not_found("sampling session", sampler_id), field="sampler_id")
        return row.base_model, row.model_path

    async def sample(self, tenant: Tenant, sampler_id: SamplingSessionId, seq_id: int | None,
                     work: SampleWork) -> SampleSubmitted:
        row = await self.get_row(tenant, sampler_id)
        served = self._ctx.registry.for_run(row.base_model)
        _validate(work, served)
        binding = self._samplers.get(sampler_id) or await self._recover_binding(tenant, row)
        await self._check_still_readable(tenant, row, binding)
        work = replace(work, adapter_id=binding.adapter_id)
        lock = self._stripes[zlib.crc32(f"{sampler_id}|{seq_id}".encode()) % _LOCK_STRIPES]
        async with lock:
            tokens = sample_tokens(work)
            request_id, is_new, requeue = await self._ctx.write_tx(
                lambda db: self._log_tx(db, tenant, sampler_id, seq_id, tokens, work.record_stability_info),
                caller=tenant.id)
            if is_new:
                self._ctx.accepted.add(request_id, tenant.id, "sample", keeps_result=work.record_stability_info)
            if is_new or requeue:
                self._ctx.enqueue(served, tenant, request_id, sampler_id, RequestKind.SAMPLE, seq_id,
                                  payload=Sample(work), num_tokens=int(work.prompt.shape[0]))
                self._ctx.sample_submissions.ring(sampler_id)
        return SampleSubmitted(request_id, sample_sequence_ids(request_id, work.num_samples))

    async def _check_still_readable(self, tenant: Tenant, row: SamplerFacts, binding: SamplerBinding) -> None:
        """A session bound to a checkpoint samples only while that very checkpoint row is readable by the
        session's tenant (deleted, unpublished or re-saved since: 404, like any checkpoint it cannot read)."""
        sampler_id, bound = row.id, bound_checkpoint_version(binding.adapter_id)
        if row.model_path is None or bound is None or not self._binding_check.due(sampler_id):
            return
        parsed = parse_path(row.model_path, "model_path")

        def tx(db: Session) -> str | None:
            try:
                checkpoint = readable_checkpoint(db, tenant, parsed)[0]
            except NotFound:
                return None
            return checkpoint_version(checkpoint.id, checkpoint.created_at)

        if await self._ctx.tx(tx) != bound:
            self._binding_check.forget(sampler_id)
            raise NotFound(f"checkpoint {parsed.uri} of sampling session {sampler_id} was deleted, unpublished or "
                           "replaced; create a new sampling client", field="sampling_session_id")
        self._binding_check.passed(sampler_id)

    async def get_row(self, tenant: Tenant, sampler_id: SamplingSessionId) -> SamplerFacts:
        """The caller's sampling session (404 if it is not the caller's), read once per process."""
        known = self._sessions.get(tenant.id, sampler_id)
        if known is not None:
            return known
        row = await self._ctx.tx(lambda db: get_sampling_session(db, TenantId(tenant.id), sampler_id))
        if row is None:  # never remembered: the next submission with this id looks it up again
            raise NotFound(not_found("sampling session", sampler_id), field="sampling_session_id")
        facts = SamplerFacts.of(row)
        self._sessions.remember(tenant.id, sampler_id, facts)
        return facts

    def _log_tx(self, db: Session, tenant: Tenant, sampler_id: SamplingSessionId,
                seq_id: int | None, tokens: int, record_stability: bool = False) -> tuple[RequestId, bool, bool]:
        """(request id, is new, queue it again): a retry of a row still `queued` is queued again, because the
        process that logged it may have died before queueing it (the scheduler drops a copy it already has)."""
        if seq_id is not None:
            existing = sample_request_for_seq(db, sampler_id, seq_id)
            if existing is not None:
                existing_id, status = existing
                return existing_id, False, status == "queued"
        # Quotas only for new requests; a 429 rolls back, so the SDK's retry (same seq_id) starts afresh.
        self._ctx.quotas.check_concurrency(db, tenant)
        row = record_request(db, TenantId(tenant.id), "sample", sampling_session_id=sampler_id, seq_id=seq_id,
                             now=self._ctx.clock())
        if record_stability:
            mark_stability_recorded(db, row.id)  # stable_reinforce may read this sample's logprobs
        self._ctx.quotas.charge_tokens(tenant, tokens)
        return row.id, True, False

    async def _bind_checkpoint(self, tenant: Tenant, session_id: SessionId, model_path: str,
                               base_model: str | None) -> SamplerBinding:
        parsed = parse_path(model_path, "model_path")

        def tx(db: Session) -> tuple[CheckpointToLoad, ServedModel]:
            if get_session(db, TenantId(tenant.id), session_id) is None:
                raise NotFound(not_found("session", session_id), field="session_id")
            checkpoint, source = readable_checkpoint(db, tenant, parsed)
            served = self._ctx.registry.for_run(source.base_model)
            if base_model is not None and base_model != source.base_model:
                raise Invalid(f"checkpoint {parsed.uri} belongs to {source.base_model}, not {base_model}",
                              field="base_model")
            local = self._ctx.store.local_path(checkpoint.storage_uri)
            return CheckpointToLoad(parsed.uri, checkpoint_version(checkpoint.id, checkpoint.created_at), local), served

        to_load, served = await self._ctx.tx(tx)
        adapter_id = await self._loader.ensure(tenant, served, to_load)
        return SamplerBinding(served.name, adapter_id)

    async def _recover_binding(self, tenant: Tenant, row: SamplerFacts) -> SamplerBinding:
        """A session this process has not bound (it was restarted): rebuild the binding from the database."""
        sampler_id = row.id
        if row.model_path is not None:
            binding = await self._bind_checkpoint(tenant, row.session_id, row.model_path, None)
        elif await self._ctx.tx(lambda db: ephemeral_save_for(db, sampler_id)) is not None:
            raise Invalid(f"sampling session {sampler_id} sampled a snapshot that did not survive a server "
                          "restart; create a new sampling client", field="sampling_session_id")
        else:
            binding = SamplerBinding(row.base_model, None)
        self._samplers.bind(sampler_id, binding)
        return binding


def sample_tokens(work: SampleWork) -> int:
    """What a sample request counts against `tokens_per_minute`: its prompt plus the most it may generate."""
    return int(work.prompt.shape[0]) + work.num_samples * work.params.max_tokens


def _validate(work: SampleWork, served: ServedModel) -> None:
    try:
        validate_sample(work, served.limits)
    except InvalidWork as exc:
        raise Invalid(str(exc), field=exc.field) from exc

