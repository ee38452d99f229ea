"""Training requests on an existing model: forward(_backward), optim_step, saves, legacy loads, rejections.

Each is an ordered submission (see `submission`): checked inside the transaction that logs it, then
queued as a command for the model's scheduler loop. Saves come in four forms, all barriers of the model:
`save_weights` (training checkpoint with optimizer state, `weights/`), named `save_weights_for_sampler`
(`sampler_weights/`, weights only), ephemeral `save_weights_for_sampler` (a snapshot adapter copy backing
a new sampling session `{session}:sample:{k}`) and `save_weights_external` (PEFT files, `external_weights/`;
age-encrypted to `<file>.age` by `EncryptedSave` when the request names recipients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import timedelta

from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import CheckpointKindName, CheckpointRef, Invalid, SaveOptions, Submitted
from services.control.context import ControlContext
from services.control.models import parse_path, readable_checkpoint
from services.control.registry import ServedModel
from services.control.samplers import SamplerBinding, SamplerDirectory, ephemeral_adapter_id
from services.control.submission import FailedSubmission, OrderedCall, OrderedSubmitter, Prepared, Preparer
from services.db.checkpoints import get_checkpoint
from services.db.errors import NotFoundError
from services.db.ids import ModelId, SessionId, TenantId, sampling_session_id
from services.db.runs import RunFacts, create_sampling_session, get_training_run
from services.domain.backend import Backend
from services.domain.training import AdamParams, AdapterId, ForwardBackwardWork, WorkError
from services.domain.validation import InvalidWork, validate_forward_backward
from services.runtime.commands import CheckpointRecord, CopyAdapter, ForwardBackward, Load, OptimStep, Save
from services.scheduler.requests import RequestKind
from services.storage.encrypted_saves import save_encrypted
from services.storage.encryption import EncryptionError, check_recipients
from services.wire.paths import TYPE_TO_SEGMENT, checkpoint_path

SAVE_KIND_NAMES: dict[CheckpointKindName, str] = {
    "training": "save_weights",
    "sampler": "save_weights_for_sampler",
    "external": "save_weights_external",
}
MAX_NAME_LENGTH = 200
MAX_TTL_S = 10 * 365 * 24 * 3600


@dataclass(frozen=True)
class ExternalSaveOptions(SaveOptions):
    """`save_weights_external` options: a non-empty `age_recipients` encrypts every exported file."""

    age_recipients: tuple[str, ...] = ()


@dataclass(frozen=True)
class EncryptedSave(Save):
    """A `save_weights_external` whose files are age-encrypted (`<file>.age`) before its row is written."""

    recipients: tuple[str, ...] = ()

    def run(self, backend: Backend) -> object:
        clash = self.clash()
        if clash is not None:
            return clash
        try:
            # Encrypted where the files are written (with S3: on the saving node, before the upload).
            size = save_encrypted(backend, self.adapter_id, self.path, self.recipients)
        except EncryptionError as exc:  # the export was discarded; no plaintext was kept
            return WorkError(f"encrypting {self.record.tinker_path} failed: {exc}", "server")
        return CheckpointRef(self.record.tinker_path, self.kind, size)


class TrainingOps:
    def __init__(self, ctx: ControlContext, submitter: OrderedSubmitter, samplers: SamplerDirectory) -> None:
        self._ctx = ctx
        self._submitter = submitter
        self._samplers = samplers

    async def forward_backward(self, tenant: Tenant, model_id: ModelId, seq_id: int,
                               work: ForwardBackwardWork) -> Submitted:
        work = replace(work, adapter_id=AdapterId(model_id))
        kind = RequestKind.FORWARD if work.forward_only else RequestKind.FORWARD_BACKWARD

        def prepare(_db: Session, _run: RunFacts, served: ServedModel) -> Prepared:
            _validate_work(work, served)
            return Prepared(kind, ForwardBackward(work), work.num_tokens, billed_tokens=work.billed_tokens)

        return await self._submitter.submit(OrderedCall(tenant, model_id, seq_id, kind.value, prepare))

    async def optim_step(self, tenant: Tenant, model_id: ModelId, seq_id: int,
                         params: AdamParams) -> Submitted:
        def prepare(_db: Session, _run: RunFacts, _served: ServedModel) -> Prepared:
            _validate_adam(params)
            return Prepared(RequestKind.OPTIM_STEP, OptimStep(AdapterId(model_id), params))

        return await self._submitter.submit(OrderedCall(tenant, model_id, seq_id, "optim_step", prepare))

    async def reject_seq_id(self, tenant: Tenant, model_id: ModelId, seq_id: int, error: str) -> None:
        await self._submitter.consume(tenant, model_id, seq_id, error)

    async def save(self, tenant: Tenant, model_id: ModelId, seq_id: int, kind: CheckpointKindName,
                   options: SaveOptions, sampling_session_seq_id: int | None = None) -> Submitted:
        if kind not in SAVE_KIND_NAMES:
            raise Invalid(f"unknown checkpoint kind {kind!r}", field="kind")
        if kind == "sampler" and options.name is None:
            prepare = self._ephemeral_preparer(tenant, model_id, sampling_session_seq_id)
        else:
            prepare = self._named_preparer(tenant, model_id, kind, options, seq_id)
        call = OrderedCall(tenant, model_id, seq_id, SAVE_KIND_NAMES[kind], prepare)
        return await self._submitter.submit(call)

    async def load_in_place(self, tenant: Tenant, model_id: ModelId, seq_id: int, path: str,
                            with_optimizer: bool) -> Submitted:
        """The legacy `load_state`: replace an existing model's adapter, ordered like any request."""
        parsed = parse_path(path)

        def prepare(db: Session, run: RunFacts, _served: ServedModel) -> Prepared:
            checkpoint, source = readable_checkpoint(db, tenant, parsed)
            if with_optimizer and checkpoint.kind != "training":
                raise Invalid(f"checkpoint {parsed.uri} holds weights only", field="optimizer")
            if source.base_model != run.base_model:
                raise Invalid(f"checkpoint {parsed.uri} was trained on {source.base_model}, "
                              f"this model on {run.base_model}", field="path")
            row = get_training_run(db, TenantId(tenant.id), model_id)
            assert row is not None  # `run` was read in this transaction
            row.lora_rank, row.lora_config = source.lora_rank, dict(source.lora_config)
            local = self._ctx.store.local_path(checkpoint.storage_uri)
            load = Load(AdapterId(model_id), local, with_optimizer, model_id, parsed.uri, self._ctx.store.remote)
            return Prepared(RequestKind.LOAD, load)

        return await self._submitter.submit(OrderedCall(tenant, model_id, seq_id, "load_weights", prepare))

    # -- saves ------------------------------------------------------------------------------------
    def _named_preparer(self, tenant: Tenant, model_id: ModelId, kind: CheckpointKindName,
                        options: SaveOptions, seq_id: int) -> Preparer:
        name = options.name

        def prepare(db: Session, _run: RunFacts, _served: ServedModel) -> Prepared:
            _validate_name(name)
            assert name is not None
            tinker_path = checkpoint_path(model_id, kind, name)
            existing = get_checkpoint(db, TenantId(tenant.id), tinker_path)
            if not options.overwrite and existing is not None:
                raise FailedSubmission(f"checkpoint {tinker_path} already exists; save under another name or "
                                       "pass overwrite=True", "user")
            self._ctx.quotas.check_storage(db, tenant, replacing=existing is not None)
            record = self._record(tenant, model_id, kind, name, options)
            if not self._ctx.store.remote:  # a remote store's names are checked where its files are
                record = replace(record, save_token=f"{model_id}/{seq_id}")
            local = self._ctx.store.local_path(record.storage_uri)
            recipients = _age_recipients(kind, options)
            if recipients:
                return Prepared(RequestKind.SAVE, EncryptedSave(AdapterId(model_id), local, False, kind, record,
                                                                recipients))
            save = Save(AdapterId(model_id), local, kind == "training", kind, record)
            return Prepared(RequestKind.SAVE, save)

        return prepare

    def _record(self, tenant: Tenant, model_id: ModelId, kind: CheckpointKindName, name: str,
                options: SaveOptions) -> CheckpointRecord:
        expires_at = None
        if options.ttl_seconds is not None:
            _validate_ttl(options.ttl_seconds)
            expires_at = self._ctx.clock() + timedelta(seconds=options.ttl_seconds)
        return CheckpointRecord(
            tenant_id=tenant.id, training_run_id=model_id, checkpoint_id=f"{TYPE_TO_SEGMENT[kind]}/{name}",
            kind=kind, tinker_path=checkpoint_path(model_id, kind, name),
            storage_uri=self._ctx.store.uri_for(tenant.id, model_id, kind, name), expires_at=expires_at,
            user_metadata={str(k): str(v) for k, v in options.user_metadata.items()},
            overwrite=options.overwrite,
        )

    def _ephemeral_preparer(self, tenant: Tenant, model_id: ModelId, seq: int | None) -> Preparer:
        if seq is None:
            raise Invalid("save_weights_for_sampler needs a path or a sampling_session_seq_id", field="path")

        def prepare(db: Session, run: RunFacts, _served: ServedModel) -> Prepared:
            if seq < 0:
                raise Invalid(f"sampling_session_seq_id must be >= 0, got {seq}",
                              field="sampling_session_seq_id")
            ssid = sampling_session_id(SessionId(run.session_id), seq)
            try:
                create_sampling_session(db, TenantId(tenant.id), SessionId(run.session_id), seq,
                                        base_model=run.base_model, now=self._ctx.clock())
            except NotFoundError as exc:  # the run's session is the tenant's, so only on a race with a delete
                raise Invalid(str(exc), field="model_id") from exc
            target = ephemeral_adapter_id(ssid)
            self._samplers.bind(ssid, SamplerBinding(run.base_model, target))
            copy = CopyAdapter(AdapterId(model_id), target, ssid, self._ctx.options.scratch_dir)
            return Prepared(RequestKind.SAVE, copy, sampling_session_id=ssid)

        return prepare


def _validate_work(work: ForwardBackwardWork, served: ServedModel) -> None:
    try:
        validate_forward_backward(work, served.limits)
    except InvalidWork as exc:
        raise Invalid(str(exc), field=exc.field) from exc
    if work.num_tokens > served.max_tokens_per_request:
        limit = served.max_tokens_per_request
        raise Invalid(f"{work.num_tokens} tokens exceed the {limit} tokens one request may hold; "
                      "send smaller batches", field="data")


def _validate_adam(params: AdamParams) -> None:
    checks = {
        "learning_rate": params.learning_rate >= 0,
        "beta1": 0 <= params.beta1 < 1,
        "beta2": 0 <= params.beta2 < 1,
        "eps": params.eps > 0,
        "weight_decay": params.weight_decay >= 0,
        "grad_clip_norm": params.grad_clip_norm >= 0,
    }
    for name, ok in checks.items():
        value = getattr(params, name)
        if not ok or not math.isfinite(value):
            raise Invalid(f"adam_params.{name}: invalid value {value}", field=f"adam_params.{name}")


def _validate_name(name: str | None) -> None:
    if not name or "/" in name or name in (".", "..") or len(name) > MAX_NAME_LENGTH:
        raise Invalid(f"checkpoint name must be 1-{MAX_NAME_LENGTH} characters without '/', got {name!r}",
                      field="path")


def _age_recipients(kind: CheckpointKindName, options: SaveOptions) -> tuple[str, ...]:
    recipients = options.age_recipients if isinstance(options, ExternalSaveOptions) else ()
    if not recipients:
        return ()
    if kind != "external":
        raise Invalid("age encryption applies to save_weights_external only", field="age_encryption_recipients")
    try:
        return check_recipients(recipients)
    except EncryptionError as exc:
        raise Invalid(str(exc), field="age_encryption_recipients") from exc


def _validate_ttl(ttl_seconds: int) -> None:
    if not 0 < ttl_seconds <= MAX_TTL_S:
        raise Invalid(f"ttl_seconds must be between 1 and {MAX_TTL_S}, got {ttl_seconds}",
                      field="ttl_seconds")

