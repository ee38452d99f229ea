"""`DatabaseCompletionHook`: what a scheduler loop's work leaves in the database.

On completion a plan item's requests become `done` (with their token count, pass id — which joins the request
log with pass logs — and start time) or `failed` (with the error and its category), a successful save writes
its checkpoint row, and usage is added to the tenant's hourly bucket, all in one transaction. The final
results are stored (the loop's `StoreResults`) just before it commits: a poll that reads "finished" finds
the result, and a client holding a result finds its request finished a moment later at most. A save
whose checkpoint row cannot be written (its name was taken meanwhile) fails as a user error rather than
handing the client a path nobody can resolve.

The `running` state is written only for items still in flight `running_after_s` after they started, by a
`RunningMarker` thread alongside the item: a commit before every pass would sit on the loop thread's critical
path for each request, while a request that finishes within a few ms is never observed as running anyway.
Transitions are conditional UPDATEs (`services.db.request_log`), so a late `running` write after `done`
changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from services.control.api import CheckpointRef
from services.db.checkpoints import create_checkpoint, delete_checkpoint
from services.db.columns import utcnow
from services.db.database import Database
from services.db.errors import ConflictError, NotFoundError
from services.db.ids import ModelId, RequestId, TenantId
from services.db.request_log import DoneMark, mark_request_failed, mark_request_running, mark_requests_done
from services.db.usage import record_usage_many
from services.domain.sampling import SampleResult
from services.domain.training import ForwardBackwardResult, WorkError
from services.runtime.commands import CheckpointRecord, ForwardBackward, Save
from services.runtime.reporting import StoreResults
from services.scheduler.requests import Completion, QueuedRequest

log = logging.getLogger(__name__)


RUNNING_AFTER_S = 0.05
"""Plan items still running after this long get their requests marked `running`."""


class DatabaseCompletionHook:
    """`CompletionHook` writing the request log, checkpoint rows and usage; one transaction per finished item
    (the successful requests' transitions and usage as one executemany each).

    `running_after_s` None writes `running` synchronously at the start of every item (one more commit each).
    """

    def __init__(self, db: Database, *, running_after_s: float | None = RUNNING_AFTER_S) -> None:
        self._db = db
        self._marker = RunningMarker(db, running_after_s) if running_after_s is not None else None

    def started(self, requests: Sequence[QueuedRequest], pass_id: str) -> None:
        item = InFlightItem(pass_id, tuple(requests), utcnow())
        if self._marker is not None:
            self._marker.schedule(item)
        else:
            mark_running(self._db, item)

    def finished(self, completions: Sequence[Completion], pass_id: str | None,
                 store: StoreResults) -> list[Completion]:
        started_at = self._marker.started_at(pass_id) if self._marker and pass_id else None
        with self._db.sessions.begin() as db:
            done = _Done()
            final = [self._finish(db, completion, pass_id, started_at, done) for completion in completions]
            done.write(db, pass_id, started_at)
            db.flush()  # a save's checkpoint row conflict shows here, before any result is stored
            store(final)  # before the commit makes the requests finished for a poll
        if self._marker is not None and pass_id is not None:
            self._marker.forget(pass_id)  # only after the commit: a retried call still knows the start time
        return final

    def _finish(self, db: Session, completion: Completion, pass_id: str | None,
                started_at: datetime | None, done: _Done) -> Completion:
        request, result = completion.request, completion.result
        tenant_id, request_id = TenantId(request.tenant_id), RequestId(request.request_id)
        if isinstance(request.payload, Save) and isinstance(result, CheckpointRef):
            problem = _write_checkpoint(db, request.payload.record, result)
            if problem is not None:
                completion = Completion(request, problem)
                result = problem
        if isinstance(result, WorkError):
            mark_request_failed(db, tenant_id, request_id, error=result.message, category=result.category,
                                pass_id=pass_id, started_at=started_at)
            return completion
        tokens = _tokens(request, result)
        loss = result.metrics.get("loss:sum") if isinstance(result, ForwardBackwardResult) else None
        done.add(DoneMark(tenant_id, request_id, tokens, loss), request.kind.value)
        return completion


class _Done:
    """The successful requests of one finished item, written together: the request-log transitions as one
    executemany and usage summed per (tenant, kind) — a packed pass of N tenants costs two statements,
    not 2N, on the loop thread's critical path."""

    def __init__(self) -> None:
        self.marks: list[DoneMark] = []
        self.usage: dict[tuple[TenantId, str], tuple[int, int]] = {}

    def add(self, mark: DoneMark, usage_kind: str) -> None:
        self.marks.append(mark)
        key = (mark.tenant_id, usage_kind)
        tokens, requests = self.usage.get(key, (0, 0))
        self.usage[key] = (tokens + (mark.num_tokens or 0), requests + 1)

    def write(self, db: Session, pass_id: str | None, started_at: datetime | None) -> None:
        mark_requests_done(db, self.marks, pass_id=pass_id, started_at=started_at)
        record_usage_many(db, self.usage)


@dataclass
class InFlightItem:
    pass_id: str
    requests: tuple[QueuedRequest, ...]
    started_at: datetime
    due: float = 0.0
    """Monotonic time from which its requests are marked running."""
    marked: bool = False


def mark_running(db: Database, *items: InFlightItem) -> None:
    """queued → running for the items' requests, in one transaction."""
    with db.sessions.begin() as session:
        for item in items:
            for request in item.requests:
                mark_request_running(session, TenantId(request.tenant_id), RequestId(request.request_id),
                                     pass_id=item.pass_id, now=item.started_at)


class RunningMarker:
    """Marks the requests of items still in flight `delay_s` after they started as `running`, on its own thread.

    The thread starts with the first item, looks for items that came due every `delay_s` (at least 10 ms), so
    an item is marked between `delay_s` and twice that after its start, and ends after `idle_exit_s` without
    new items, so an idle hook holds no thread. It polls rather than being woken per item because a wake-up
    at the start of every pass would make it compete with the pass for the GIL. A failed write is logged and
    dropped: the finishing transaction records the pass id and the start time anyway, `running` only shows
    a long item's progress in the meantime.
    """

    def __init__(self, db: Database, delay_s: float, *, idle_exit_s: float = 10.0) -> None:
        self._db = db
        self._delay_s = delay_s
        self._poll_s = max(delay_s, 0.01)
        self._idle_exit_s = idle_exit_s
        self._cond = threading.Condition()
        self._items: dict[str, InFlightItem] = {}
        self._last_scheduled = 0.0
        self._thread: threading.Thread | None = None

    def schedule(self, item: InFlightItem) -> None:
        now = time.monotonic()
        item.due = now + self._delay_s
        with self._cond:
            self._items[item.pass_id] = item
            self._last_scheduled = now
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="request-log:running", daemon=True)
                self._thread.start()

    def started_at(self, pass_id: str) -> datetime | None:
        with self._cond:
            item = self._items.get(pass_id)
        return item.started_at if item is not None else None

    def forget(self, pass_id: str) -> None:
        with self._cond:
            self._items.pop(pass_id, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                due = self._wait_for_due()
                if not due:
                    self._thread = None
                    return
            try:
                mark_running(self._db, *due)
            except Exception:  # noqa: BLE001 - see the class docstring
                log.warning("could not mark %d plan items running", len(due), exc_info=True)

    def _wait_for_due(self) -> list[InFlightItem]:
        """Under the lock: the items that came due (marked as taken), or [] once idle for `idle_exit_s`."""
        while True:
            now = time.monotonic()
            waiting = [item for item in self._items.values() if not item.marked]
            due = [item for item in waiting if item.due <= now]
            if due:
                for item in due:
                    item.marked = True
                return due
            if not waiting and now - self._last_scheduled >= self._idle_exit_s:
                return []
            self._cond.wait(self._poll_s)


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
    if isinstance(request.payload, ForwardBackward):
        return request.payload.work.billed_tokens  # T x K, as tokens_per_minute charged it
    return request.num_tokens
