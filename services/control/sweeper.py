"""The sweeper: enforces checkpoint TTLs and closes abandoned sessions, on a timer, in every deployment.

Without it a TTL is only a label: expired checkpoints would stay on disk (and in the tenant's storage
quota) forever, and sessions whose client vanished would count against `max_sessions` forever.

Each round (`sweep_once`):
- expired checkpoints (`expires_at` passed, any tenant): the row is deleted first, then the files (or
  objects) through the `CheckpointStore`, the same order as a tenant's own delete, so a failed file
  deletion never leaves a row that points at nothing (the files are retried by nobody; the error is
  logged). Sampling sessions bound to a deleted checkpoint stop sampling at their next request (the
  control plane re-checks the binding).
- stale sessions (unfinished, no heartbeat for `stale_session_s`; the SDK beats every 10 s) are finished.
- debris of killed uploads (remote stores only: objects of checkpoints that never got their manifest, and
  unfinished multipart uploads) older than `incomplete_upload_age_s` is removed through the store's
  `sweep_incomplete`, at most once per `incomplete_sweep_every_s` (it lists the whole bucket prefix). The
  age threshold keeps uploads in progress; it must exceed the longest save.

Both work in pages of `batch` rows per transaction. Several gateway processes may sweep at once (cluster
mode): deleting an already deleted row finds nothing and finishing a finished session is a no-op, so
they never conflict. `SweeperThread` runs rounds every `interval_s` on a daemon thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol, runtime_checkable

from services.db.checkpoints import delete_checkpoint, find_expired_checkpoints
from services.db.columns import utcnow
from services.db.database import Database
from services.db.ids import SessionId, TenantId
from services.db.sessions import find_stale_sessions, finish_session
from services.storage.protocol import CheckpointStore, StorageError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepOptions:
    interval_s: float = 60.0
    """Time between two rounds."""
    stale_session_s: float = 3600.0
    """A session without a heartbeat for this long is finished."""
    batch: int = 200
    """Rows per transaction."""
    max_batches: int = 50
    """Transactions per kind per round (a backlog is worked off over several rounds)."""
    incomplete_upload_age_s: float = 3600.0
    """Debris of an upload without a manifest is removed once its newest object is this old."""
    incomplete_sweep_every_s: float = 600.0
    """Least time between two debris sweeps (each lists every object under the store's prefix)."""


@runtime_checkable
class IncompleteUploads(Protocol):
    """A remote store that can remove what killed uploads left (`S3CheckpointStore`)."""

    def sweep_incomplete(self, older_than_s: float = 3600.0, *, now: float | None = None) -> int: ...


@dataclass
class SweepReport:
    checkpoints_deleted: int = 0
    files_failed: int = 0
    sessions_finished: int = 0
    incomplete_objects_removed: int = 0


class Sweeper:
    """One sweeping round at a time over a database and a checkpoint store (thread-safe enough: each round
    is its own transactions)."""

    def __init__(self, db: Database, store: CheckpointStore, options: SweepOptions | None = None,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self._db = db
        self._store = store
        self.options = options or SweepOptions()
        self._clock = clock
        self._last_debris_sweep: datetime | None = None

    def sweep_once(self) -> SweepReport:
        report = SweepReport()
        self._expire_checkpoints(report)
        self._finish_stale_sessions(report)
        self._remove_upload_debris(report)
        if report.checkpoints_deleted or report.sessions_finished or report.incomplete_objects_removed:
            log.info("sweeper: %d expired checkpoints deleted (%d with file errors), %d stale sessions finished, "
                     "%d objects of incomplete uploads removed", report.checkpoints_deleted, report.files_failed,
                     report.sessions_finished, report.incomplete_objects_removed)
        return report

    def _remove_upload_debris(self, report: SweepReport) -> None:
        if not isinstance(self._store, IncompleteUploads):
            return  # a local store writes into place; nothing is left behind by a killed save
        now = self._clock()
        last = self._last_debris_sweep
        if last is not None and (now - last).total_seconds() < self.options.incomplete_sweep_every_s:
            return
        self._last_debris_sweep = now
        try:
            report.incomplete_objects_removed = self._store.sweep_incomplete(
                self.options.incomplete_upload_age_s, now=now.timestamp())
        except (StorageError, OSError) as exc:  # S3 down: the next sweep retries
            log.warning("sweeper: debris of incomplete uploads not removed: %s", exc)

    def _expire_checkpoints(self, report: SweepReport) -> None:
        for _ in range(self.options.max_batches):
            now = self._clock()
            with self._db.sessions.begin() as db:
                expired = find_expired_checkpoints(db, now=now, limit=self.options.batch)
                deleted = [row for row in expired
                           if delete_checkpoint(db, TenantId(row.tenant_id), row.tinker_path) is not None]
                uris = [(row.tinker_path, row.storage_uri) for row in deleted]
            for tinker_path, uri in uris:  # after the commit: rows first, then files
                try:
                    self._store.delete(uri)
                except (StorageError, OSError) as exc:
                    report.files_failed += 1
                    log.warning("sweeper: files of expired checkpoint %s not deleted: %s", tinker_path, exc)
            report.checkpoints_deleted += len(uris)
            if len(expired) < self.options.batch:
                return

    def _finish_stale_sessions(self, report: SweepReport) -> None:
        for _ in range(self.options.max_batches):
            now = self._clock()
            before = now - timedelta(seconds=self.options.stale_session_s)
            with self._db.sessions.begin() as db:
                stale = find_stale_sessions(db, heartbeat_before=before, limit=self.options.batch)
                for row in stale:
                    finish_session(db, TenantId(row.tenant_id), SessionId(row.id), now=now)
            report.sessions_finished += len(stale)
            if len(stale) < self.options.batch:
                return


class SweeperThread:
    """Runs `sweeper.sweep_once()` every `interval_s` on a daemon thread until `stop()`."""

    def __init__(self, sweeper: Sweeper) -> None:
        self._sweeper = sweeper
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="carpool-sweeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self._sweeper.options.interval_s):
            try:
                self._sweeper.sweep_once()
            except Exception:  # noqa: BLE001 - a failed round (database down) is retried next interval
                log.exception("sweeper round failed")
