"""What every part of the service control plane shares: its dependencies, options and a few primitives.

`ControlContext` bundles the database, the queue / result store / notifier set, the checkpoint store, the
registry of served base models and the requests accepted here but not yet collected, plus the primitives the
parts build on: running a transaction off the event loop (`tx`), putting work or an immediate error result
on the queue (`enqueue`, `fail_now`), waiting for a request's stored result (`await_result`, the same get →
wait → get long-poll the gateway's `retrieve` uses), and the few read queries the `services.db` repositories
do not offer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Select, and_, bindparam, func, select
from sqlalchemy.orm import Session, aliased

from services.auth.tenants import Tenant
from services.control.pending import AcceptedRequests
from services.control.quotas import QuotaGate, QuotaOptions
from services.control.registry import ModelRegistry, ServedModel
from services.control.submission_bell import SubmissionBell
from services.db.columns import utcnow
from services.db.database import Database
from services.db.group_commit import GroupCommitter
from services.db.ids import ModelId, RequestId, SamplingSessionId, SessionId, TenantId
from services.db.models import CheckpointRow, RequestRow, SessionRow, TrainingRunRow
from services.db.prepared import PreparedStatement
from services.db.request_log import UNFINISHED, status_in
from services.db.runs import RunFacts
from services.db.statements import core
from services.domain.training import WorkError
from services.jobqueue.protocol import (
    DEFAULT_ANSWERED_KEEP_S,
    Notifier,
    ResultStatus,
    ResultStore,
    StoredResult,
    WorkQueue,
)
from services.scheduler.requests import ModelId as QueueModelId
from services.scheduler.requests import QueuedRequest, RequestKind
from services.scheduler.requests import RequestId as QueueRequestId
from services.scheduler.requests import TenantId as QueueTenantId
from services.storage.protocol import CheckpointStore

_T = TypeVar("_T")


@dataclass(frozen=True)
class ControlOptions:
    long_poll_max_s: float = 30.0
    """Longest a `retrieve` holds (the SDK's read timeout is 45 s)."""
    answered_result_s: float = DEFAULT_ANSWERED_KEEP_S
    """How long a result stays in the result store once `retrieve` answered it to its owner (for a retry of a
    lost response; 0: dropped at once). Unretrieved results keep their full TTL. The SDK fetches each result
    once, so this, not the hour of the TTL, bounds the store's memory (`ResultStore.answered`)."""
    heartbeat_write_s: float = 30.0
    """A session's `last_heartbeat_at` is written at most this often (`sessions.heartbeat_write_interval`
    derives the service's from its stale-session limit)."""
    download_url_ttl_s: float = 3600.0
    """Lifetime of signed external-weights download URLs."""
    sampler_load_timeout_s: float = 300.0
    """How long `create_sampling_session` waits for a checkpoint to load before giving up (503)."""
    sampler_recheck_s: float = 5.0
    """How long a sampling session's checkpoint counts as still readable before the next sample re-checks it
    (bounds how long a deleted, unpublished or replaced checkpoint keeps being sampled)."""
    default_max_models: int | None = None
    """Models per tenant when the tenant row sets no `max_models` (None: unlimited)."""
    scratch_dir: Path | None = None
    """Where adapter copies for ephemeral samplers are staged (None: the system temp dir)."""
    quotas: QuotaOptions = field(default_factory=QuotaOptions)
    """Quota defaults and timings, and the saturation thresholds of `queue_state` (see `quotas`)."""
    group_commit: bool | None = None
    """Submissions' write transactions share commits on one writer thread (`services.db.group_commit`).
    None: on for SQLite, where one writer runs at a time anyway; off for PostgreSQL, whose connections
    write in parallel."""


@dataclass(frozen=True)
class ControlContext:
    db: Database
    queue: WorkQueue
    results: ResultStore
    notifier: Notifier
    store: CheckpointStore
    registry: ModelRegistry
    options: ControlOptions
    clock: Callable[[], datetime] = utcnow
    quotas: QuotaGate = field(default_factory=QuotaGate)
    writes: GroupCommitter | None = None
    """Where `write_tx` runs its transactions (None: on the blocking pool like `tx`)."""
    accepted: AcceptedRequests = field(default_factory=AcceptedRequests)
    """Requests accepted here whose result is not collected yet (spares their first poll a read)."""
    sample_submissions: SubmissionBell = field(init=False)
    """Rung with a sampling session's id when one of its samples is queued here; rings through `notifier`, so
    the batched polls of every gateway process hear it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sample_submissions", SubmissionBell(self.notifier))  # frozen: set once here

    async def tx(self, fn: Callable[[Session], _T]) -> _T:
        """Run `fn` in one transaction on a worker thread (commit on return, roll back on raise)."""
        return await asyncio.to_thread(self._run_tx, fn)

    async def write_tx(self, fn: Callable[[Session], _T], *, caller: str = "") -> _T:
        """A short write transaction of a submission: in a group commit when `writes` is set (its own
        savepoint; its exception rolls back its writes only), else as `tx`. `caller` keeps groups fair."""
        if self.writes is None:
            return await self.tx(fn)
        return await self.writes.run(fn, caller=caller)

    def _run_tx(self, fn: Callable[[Session], _T]) -> _T:
        with self.db.sessions.begin() as session:
            return fn(session)

    def enqueue(
        self,
        served: ServedModel,
        tenant: Tenant,
        request_id: RequestId,
        model_id: str,
        kind: RequestKind,
        seq_id: int | None,
        *,
        payload: object = None,
        num_tokens: int = 0,
    ) -> None:
        """Put one request on the queue of `served`'s scheduler loop."""
        request = QueuedRequest(
            request_id=QueueRequestId(request_id),
            tenant_id=QueueTenantId(tenant.id),
            model_id=QueueModelId(model_id),
            kind=kind,
            seq_id=seq_id,
            num_tokens=num_tokens,
            enqueued_at=time.monotonic(),  # the scheduler's default clock
            payload=payload,
        )
        self.queue.enqueue(served.queue, request)

    def fail_now(self, request_id: RequestId, error: str, category: str = "user") -> None:
        """Store an error result for a request that will never run, and wake its waiters."""
        work_error = WorkError(error, "server" if category == "server" else "user")
        self.results.put(request_id, StoredResult(ResultStatus.ERROR, work_error))
        self.notifier.publish(request_id)

    async def await_result(self, request_id: RequestId, timeout_s: float) -> StoredResult | None:
        """The stored result, waiting up to `timeout_s` for it (get → wait → get); None if not in time."""
        stored = await self.results.get(request_id)
        if stored is not None or timeout_s <= 0:
            return stored
        await self.notifier.wait(request_id, timeout_s)
        return await self.results.get(request_id)


def not_found(what: str, ident: str) -> str:
    """The one message for an id that is missing or another tenant's (they must be indistinguishable)."""
    return f"{what} {ident} not found"


# -- lookups the repositories lack: dedupe by seq id, page counts ------------------------------------
# The database is the source of truth for request ids (production runs several gateway processes);
# callers have already checked that the model or session belongs to the tenant.


def request_for_seq(db: Session, model_id: ModelId, seq_id: int) -> RequestRow | None:
    """The request that took `seq_id` of a run (the unique (model_id, seq_id) row), if any."""
    return db.scalars(_REQUEST_FOR_SEQ, {"model_id": model_id, "seq_id": seq_id}).one_or_none()


_REQUEST_FOR_SEQ = select(RequestRow).where(RequestRow.model_id == bindparam("model_id"),
                                            RequestRow.seq_id == bindparam("seq_id"))
"""Built once: every ordered submission looks its seq id up."""


@dataclass(frozen=True)
class TakenSeq:
    """The request row that holds a seq id: what a retry of its submission needs to know."""

    request_id: RequestId
    kind: str
    status: str
    started: bool
    """Whether a scheduler ever reported it running (an edge refusal never is)."""


@dataclass(frozen=True)
class SubmissionFacts:
    """What an ordered submission reads before it decides: the run, the row holding its seq id, and the
    tenant's unfinished requests (counted only when a concurrency limit is in force)."""

    run: RunFacts
    taken: TakenSeq | None
    unfinished: int | None


def submission_facts(db: Session, tenant_id: TenantId, model_id: ModelId, seq_id: int, *,
                     count_unfinished: bool) -> SubmissionFacts | None:
    """The run (None if it is not the tenant's), its seq id's row and the unfinished count in ONE statement:
    every ordered submission reads them, and at 512 cluster tenants their three round trips were a third of
    the gateway's database time (py-spy)."""
    stmt = _FACTS_COUNTED if count_unfinished else _FACTS
    rows = stmt.execute(db, {"model_id": model_id, "tenant_id": tenant_id, "seq_id": seq_id})
    if not rows:
        return None
    row = rows[0]
    taken = None if row[3] is None else TakenSeq(RequestId(row[3]), row[4], row[5], row[6] is not None)
    return SubmissionFacts(RunFacts(ModelId(row[0]), SessionId(row[1]), row[2]), taken,
                           int(row[7]) if count_unfinished else None)


def _facts_statement(count_unfinished: bool) -> Select[Any]:
    run, request = TrainingRunRow, RequestRow
    columns: list[Any] = [run.id, run.session_id, run.base_model,
                          request.id, request.kind, request.status, request.started_at]
    if count_unfinished:
        # Its own alias, never correlated: the count is over all the tenant's requests, not the joined row.
        counted = aliased(RequestRow)
        columns.append(select(func.count()).select_from(counted)
                       .where(counted.tenant_id == bindparam("tenant_id"), status_in(counted.status, UNFINISHED))
                       .correlate(None).scalar_subquery())
    # (model_id, seq_id) is unique: the outer join adds at most one row to the run's.
    taken = and_(request.model_id == run.id, request.seq_id == bindparam("seq_id"))
    return (select(*columns).select_from(run).outerjoin(request, taken)
            .where(run.id == bindparam("model_id"), run.tenant_id == bindparam("tenant_id")))


_FACTS, _FACTS_COUNTED = PreparedStatement(_facts_statement(False)), PreparedStatement(_facts_statement(True))


def sample_request_for_seq(db: Session, sampling_id: SamplingSessionId, seq_id: int) -> tuple[RequestId, str] | None:
    """(id, status) of the first sample request of a sampling session with this seq_id (retries map onto it)."""
    row = core(db).execute(_SAMPLE_FOR_SEQ, {"sampling_id": sampling_id, "seq_id": seq_id}).first()
    return None if row is None else (RequestId(row[0]), row[1])


_SAMPLE_FOR_SEQ = (select(RequestRow.id, RequestRow.status)
                   .where(RequestRow.sampling_session_id == bindparam("sampling_id"),
                          RequestRow.seq_id == bindparam("seq_id"), RequestRow.model_id.is_(None))
                   .order_by(RequestRow.created_at, RequestRow.id).limit(1))
"""Built once: every sample submission with a seq id looks it up (a Core statement on the session's connection)."""


def ephemeral_save_for(db: Session, sampling_id: SamplingSessionId) -> RequestRow | None:
    """The save that created an ephemeral sampling session (None for sessions made from a path or base)."""
    stmt = select(RequestRow).where(
        RequestRow.sampling_session_id == sampling_id, RequestRow.kind == "save_weights_for_sampler"
    )
    return db.scalars(stmt.limit(1)).first()


def count_sessions(db: Session, tenant_id: TenantId) -> int:
    return _count(db, select(func.count()).where(SessionRow.tenant_id == tenant_id))


def count_training_runs(db: Session, tenant_id: TenantId, session_id: SessionId | None = None) -> int:
    stmt = select(func.count()).where(TrainingRunRow.tenant_id == tenant_id)
    if session_id is not None:
        stmt = stmt.where(TrainingRunRow.session_id == session_id)
    return _count(db, stmt)


def count_checkpoints(db: Session, tenant_id: TenantId, training_run_id: ModelId | None = None) -> int:
    stmt = select(func.count()).where(CheckpointRow.tenant_id == tenant_id)
    if training_run_id is not None:
        stmt = stmt.where(CheckpointRow.training_run_id == training_run_id)
    return _count(db, stmt)


def _count(db: Session, stmt: Select[tuple[int]]) -> int:
    return int(db.scalar(stmt) or 0)
