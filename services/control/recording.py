"""`DatabaseCompletionHook`: what a scheduler loop's work leaves in the database.

On start of a plan item its requests become `running` (with the pass id, which joins the request log with
pass logs); on completion they become `done` (with their token count) or `failed` (with the error and its
category), a successful save writes its checkpoint row, and usage is added to the tenant's hourly bucket.
A save whose checkpoint row cannot be written (its name was taken meanwhile) fails as a user error rather
than handing the client a path nobody can resolve.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy.orm import Session

from services.control.api import CheckpointRef
from services.db.checkpoints import create_checkpoint, delete_checkpoint
from services.db.columns import utcnow
from services.db.database import Database
from services.db.errors import ConflictError, NotFoundError
from services.db.ids import ModelId, RequestId, TenantId
from services.db.request_log import mark_request_done, mark_request_failed, mark_request_running
from services.db.usage import record_usage
from services.domain.sampling import SampleResult
from services.domain.training import WorkError
from services.runtime.commands import CheckpointRecord, Save
from services.scheduler.requests import Completion, QueuedRequest

log = logging.getLogger(__name__)


class DatabaseCompletionHook:
    """`CompletionHook` writing the request log, checkpoint rows and usage; one transaction per call."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def started(self, requests: Sequence[QueuedRequest], pass_id: str) -> None:
        now = utcnow()
        with self._db.sessions.begin() as db:
            for request in requests:
                mark_request_running(db, TenantId(request.tenant_id), RequestId(request.request_id),
                                     pass_id=pass_id, now=now)

    def finished(self, completions: Sequence[Completion], pass_id: str | None) -> list[Completion]:
        with self._db.sessions.begin() as db:
            return [self._finish(db, completion, pass_id) for completion in completions]

    def _finish(self, db: Session, completion: Completion, pass_id: str | None) -> Completion:
        request, result = completion.request, completion.result
        tenant_id, request_id = TenantId(request.tenant_id), RequestId(request.request_id)
        if isinstance(request.payload, Save) and isinstance(result, CheckpointRef):
            problem = _write_checkpoint(db, request.payload.record, result)
            if problem is not None:
                completion = Completion(request, problem)
                result = problem
        if isinstance(result, WorkError):
            mark_request_failed(db, tenant_id, request_id, error=result.message, category=result.category)
            return completion
        tokens = _tokens(request, result)
        mark_request_done(db, tenant_id, request_id, num_tokens=tokens, pass_id=pass_id)
        record_usage(db, tenant_id, request.kind.value, tokens=tokens)
        return completion


def _write_checkpoint(db: Session, record: CheckpointRecord, ref: CheckpointRef) -> WorkError | None:
    """The checkpoint row of a finished save; a `WorkError` if it cannot be written."""
    tenant_id = TenantId(record.tenant_id)
    if record.overwrite:
        delete_checkpoint(db, tenant_id, record.tinker_path)
    try:
        create_checkpoint(
            db, tenant_id, ModelId(record.training_run_id), record.checkpoint_id, kind=record.kind,
            tinker_path=record.tinker_path, storage_uri=record.storage_uri, size_bytes=ref.size_bytes,
            expires_at=record.expires_at, user_metadata=dict(record.user_metadata),
        )
    except (ConflictError, NotFoundError) as exc:
        log.warning("checkpoint %s not recorded: %s", record.tinker_path, exc)
        return WorkError(f"checkpoint {record.tinker_path} could not be recorded: {exc}", "user")
    return None


def _tokens(request: QueuedRequest, result: object) -> int:
    """Tokens a finished request processed: its pass tokens, or prompt plus generated tokens of a sample."""
    if isinstance(result, SampleResult):
        generated = sum(len(s.tokens) for s in result.sequences)
        return request.num_tokens + generated
    return request.num_tokens
