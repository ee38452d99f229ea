"""What lets a cluster scheduler take over from a dead one and ride out restarts of its stores.

Take-over. A fresh `Scheduler` expects every model at seq 0, but a successor starts mid-stream: the queue
hands it the predecessor's unacknowledged requests (seq 7, 8, ...) and new ones. `RecoveringScheduler`
opens each model, the first time it sees it, where the request log says it stands: at the lowest seq id
still unfinished (whose result is not stored either), else at the run's next free seq id. A redelivered
request below that position finished already (its result is stored): it is acknowledged without running
again. If its row is unfinished (its scheduler died before writing its bookkeeping, see
`services.runtime.unrecorded`), the loop first records it from the stored result. One that was in flight
on a replica is dispatched again and the replica answers it from memory (`replica_executor`), so nothing
runs twice.

Outages. `RetryingHook` retries the database hook while PostgreSQL is unreachable, so the loop waits
for the database instead of delivering results whose request rows never leave `running` (that would
also mislead a later take-over). `retry_database` does the same for any other call.

Order. The loop's hook stores each result before it logs the request as finished
(`services.runtime.reporting.StoreResults`), so a take-over or a poll never reads "finished, result gone".

Lease. At most one scheduler per base model is active: `SchedulerLease` SETs `{p}:lease:{base}` NX with a
TTL and renews it every third of the TTL; a standby polls the same SET NX and takes over once the key
expires. Taking the lease also yields a *generation*, a
number larger than any earlier holder's (INCR, lifted to the wall clock in ms so it keeps growing even
if Redis lost the counter): replicas refuse calls of an older generation, so a holder that stalled past
its TTL (GC pause, network partition) cannot interleave steps with its successor.

Renewal survives a Redis restart: if the key is simply gone (nobody else took it) the holder sets it
again; only a different holder, or no successful renewal for a whole TTL, counts as losing the lease.

Lost deliveries. XREADGROUP moves entries to the consumer's pending list *before* the answer reaches the
consumer. When the connection drops at that moment (Redis restarting, a network cut), the entries stay
pending for a live consumer that never saw them: `recover()` only runs at start-up, so they would wait
forever, and so would their clients. `GuardedQueue` remembers which entries it handed to the loop and
not yet acknowledged; every `check_every_s` it lists this consumer's pending entries and hands out again
the ones the loop never got and that have been idle for a whole check interval (entries `recover()`
re-queued are handed out by the next claims, well within that). Nothing the loop holds is handed out
twice, so nothing is acknowledged early. The same sweep adopts entries left pending for *another*
consumer: a scheduler that was deposed (its lease lapsed during a Redis restart, say) can claim entries
after its successor's `recover()` and before it notices; its replica calls are then fenced and it answers
none of them (`services.runtime.dispatch`), so the leader must take them over or their clients would wait
forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, TypeVar

import redis
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from services.db.database import Database
from services.db.models import RequestRow, TrainingRunRow
from services.db.request_log import UNFINISHED
from services.jobqueue.codec import CodecError, decode_request
from services.jobqueue.protocol import Delivery
from services.jobqueue.redis_queue import DEFAULT_GROUP, PENDING_PAGE, RedisWorkQueue, default_retry
from services.runtime.redis_replicas import ClusterKeys, as_text
from services.runtime.reporting import CompletionHook, StoreResults
from services.scheduler.policy import SchedulerLimits
from services.scheduler.requests import Admission, Completion, ModelId, QueuedRequest
from services.scheduler.scheduler import Scheduler

T = TypeVar("T")
log = logging.getLogger(__name__)

DEFAULT_OUTAGE_S = 300.0
"""How long database calls are retried before the failure is let through."""

class Position(NamedTuple):
    """Where a model resumes, as far as durable state tells."""

    next_seq: int
    """The next seq id to run."""
    unrecorded: frozenset[str] = frozenset()
    """Requests below `next_seq` that ran (their results are stored) but whose rows are unfinished: a
    predecessor died before writing their bookkeeping."""


PositionLookup = Callable[[ModelId], Position]


def is_connection_error(error: BaseException) -> bool:
    """A database error that a reconnect may cure (server restarting or unreachable)."""
    if isinstance(error, OperationalError | InterfaceError):
        return True
    return isinstance(error, DBAPIError) and error.connection_invalidated


def retry_database(operation: Callable[[], T], *, outage_s: float = DEFAULT_OUTAGE_S) -> T:
    """Run `operation`, retrying connection errors with backoff for up to `outage_s`."""
    deadline = time.monotonic() + outage_s
    delay = 0.1
    while True:
        try:
            return operation()
        except Exception as error:
            if not is_connection_error(error) or time.monotonic() + delay > deadline:
                raise
            log.warning("database unreachable (%s); retrying in %.1f s", type(error).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


class RecoveringScheduler(Scheduler):
    """A `Scheduler` that starts each model at its durable position (see the module docstring)."""

    def __init__(self, positions: PositionLookup, limits: SchedulerLimits | None = None) -> None:
        super().__init__(limits)
        self._positions = positions
        self._starts: dict[ModelId, int] = {}
        self._unrecorded: set[str] = set()

    def submit(self, request: QueuedRequest) -> Admission:
        if self._finished_before_start(request):
            unrecorded = request.request_id in self._unrecorded
            self._unrecorded.discard(request.request_id)
            return Admission(request.request_id, is_new=False, unrecorded=unrecorded)
        return super().submit(request)

    def _finished_before_start(self, request: QueuedRequest) -> bool:
        ordered = request.kind.is_ordered and request.seq_id is not None and request.problem() is None
        return ordered and request.seq_id < self._start_of(request.model_id)  # type: ignore[operator]

    def _start_of(self, model_id: ModelId) -> int:
        start = self._starts.get(model_id)
        if start is None:
            start, unrecorded = self._positions(model_id)
            self._starts[model_id] = start
            self._unrecorded.update(unrecorded)
            self.open_model(model_id, start)
            if start:
                log.info("model %s resumes at seq %d", model_id, start)
        return start


class DatabasePositions:
    """`PositionLookup` from the request log; `has_result` tells finished requests whose rows lag behind."""

    def __init__(self, db: Database, has_result: Callable[[str], bool], *,
                 outage_s: float = DEFAULT_OUTAGE_S) -> None:
        self._db = db
        self._has_result = has_result
        self._outage_s = outage_s

    def __call__(self, model_id: ModelId) -> Position:
        unfinished, next_free = retry_database(lambda: self._read(model_id), outage_s=self._outage_s)
        ran: list[str] = []
        for seq_id, request_id in unfinished:
            if not self._has_result(request_id):
                return Position(seq_id, frozenset(ran))
            ran.append(request_id)
        return Position(next_free, frozenset(ran))

    def _read(self, model_id: ModelId) -> tuple[list[tuple[int, str]], int]:
        with self._db.sessions.begin() as session:
            rows = session.execute(
                select(RequestRow.seq_id, RequestRow.id)
                .where(RequestRow.model_id == model_id, RequestRow.status.in_(UNFINISHED),
                       RequestRow.seq_id.is_not(None))
                .order_by(RequestRow.seq_id)
            ).all()
            next_free = session.scalar(select(TrainingRunRow.next_seq_id).where(TrainingRunRow.id == model_id))
        return [(int(seq), str(rid)) for seq, rid in rows], int(next_free or 0)


class RetryingHook:
    """A `CompletionHook` that waits out database outages of `inner` instead of skipping its bookkeeping."""

    def __init__(self, inner: CompletionHook, *, outage_s: float = DEFAULT_OUTAGE_S) -> None:
        self._inner = inner
        self._outage_s = outage_s

    def started(self, requests: Sequence[QueuedRequest], pass_id: str) -> None:
        retry_database(lambda: self._inner.started(requests, pass_id), outage_s=self._outage_s)

    def finished(self, completions: Sequence[Completion], pass_id: str | None,
                 store: StoreResults) -> list[Completion]:
        # A retry may store again: storing is idempotent.
        return retry_database(lambda: self._inner.finished(completions, pass_id, store), outage_s=self._outage_s)


_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
elseif not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_NEXT_GENERATION = """
local generation = redis.call('INCR', KEYS[1])
local floor = tonumber(ARGV[1])
if generation < floor then
  redis.call('SET', KEYS[1], floor)
  generation = floor
end
return generation
"""


class SchedulerLease:
    """The lease of one base model's scheduler, held by `holder` (unique per scheduler process)."""

    def __init__(self, client: redis.Redis, keys: ClusterKeys, holder: str, *, ttl_s: float = 10.0,
                 on_lost: Callable[[], None] | None = None) -> None:
        self._client = client
        self.keys = keys
        self.holder = holder
        self._ttl_ms = max(100, int(ttl_s * 1000))
        self._on_lost = on_lost or (lambda: None)
        self._held = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.generation = 0

    @property
    def held(self) -> bool:
        return self._held.is_set()

    def fence(self) -> int:
        """The generation to stamp on replica calls."""
        return self.generation

    def try_acquire(self) -> bool:
        try:
            if not self._client.set(self.keys.lease, self.holder, nx=True, px=self._ttl_ms):
                return False
            floor = int(time.time() * 1000)
            self.generation = int(self._client.eval(_NEXT_GENERATION, 1, self.keys.fence, floor))
        except redis.RedisError as error:
            log.warning("%s: lease attempt failed: %s", self.keys.base_model, error)
            return False
        self._held.set()
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_forever, name=f"lease:{self.keys.base_model}",
                                        daemon=True)
        self._thread.start()
        log.info("%s: scheduler %s holds the lease (generation %d)", self.keys.base_model, self.holder,
                 self.generation)
        return True

    def acquire(self, stop: threading.Event, poll_s: float = 1.0) -> bool:
        """Wait as a standby until the lease is ours (True) or `stop` is set (False)."""
        while not stop.is_set():
            if self.try_acquire():
                return True
            stop.wait(poll_s)
        return False

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._held.is_set():
            self._held.clear()
            try:
                self._client.eval(_RELEASE, 1, self.keys.lease, self.holder)
            except redis.RedisError as error:
                log.warning("%s: lease release failed (it will expire): %s", self.keys.base_model, error)

    def _renew_forever(self) -> None:
        renewed_at = time.monotonic()
        while not self._stop.wait(self._ttl_ms / 3000):
            try:
                if self._client.eval(_RENEW, 1, self.keys.lease, self.holder, self._ttl_ms):
                    renewed_at = time.monotonic()
                    continue
                reason = "another scheduler holds it"
            except redis.RedisError as error:
                if time.monotonic() - renewed_at < self._ttl_ms / 1000:
                    log.warning("%s: lease renewal failed (%s); retrying", self.keys.base_model, error)
                    continue
                reason = f"not renewed for a whole TTL ({error})"
            self._lose(reason)
            return

    def _lose(self, reason: str) -> None:
        log.error("%s: scheduler %s lost the lease: %s", self.keys.base_model, self.holder, reason)
        self._held.clear()
        self._on_lost()


class GuardedQueue:
    """`WorkQueue` delegating to `queue`, plus the lost-delivery sweep (see the module docstring)."""

    def __init__(self, queue: RedisWorkQueue, client: redis.Redis, *, group: str = DEFAULT_GROUP,
                 check_every_s: float = 2.0) -> None:
        self._queue = queue
        self._client = client
        self._group = group
        self._check_every_s = check_every_s
        self._retry = default_retry()
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._checked_at = time.monotonic()

    def enqueue(self, base_model: str, request: object) -> str:
        return self._queue.enqueue(base_model, request)  # type: ignore[arg-type]

    def claim(self, base_model: str, max_items: int, timeout_s: float = 0.0) -> list[Delivery]:
        deliveries = self._queue.claim(base_model, max_items, timeout_s)
        if time.monotonic() - self._checked_at >= self._check_every_s:
            self._checked_at = time.monotonic()
            deliveries += self._lost(base_model)
        with self._lock:
            self._held.update(d.delivery_id for d in deliveries)
        return deliveries

    def ack(self, base_model: str, delivery_ids: Iterable[str]) -> int:
        ids = list(delivery_ids)
        with self._lock:
            self._held.difference_update(ids)
        return self._queue.ack(base_model, ids)

    def recover(self, base_model: str) -> int:
        return self._queue.recover(base_model)

    def depth(self, base_model: str) -> int:
        return self._queue.depth(base_model)

    def _lost(self, base_model: str) -> list[Delivery]:
        """Entries idle for `check_every_s` that the loop does not hold: pending for this consumer but never
        received, or pending for another consumer — a scheduler that claimed them after this one's recovery
        and then died, stopped or was fenced (see `dispatch`). Only the lease holder runs a loop, so such
        entries are nobody's; XCLAIM's min-idle check leaves any that were just delivered alone."""
        key = self._queue.stream_key(base_model)
        idle_ms = int(self._check_every_s * 1000)
        try:
            pending = self._retry.call_with_retry(
                lambda: self._client.xpending_range(key, self._group, "-", "+", PENDING_PAGE, idle=idle_ms),
                lambda error: log.warning("redis retry: %s", error))
        except redis.ResponseError:  # no group yet: nothing can be pending
            return []
        with self._lock:
            lost = [as_text(p["message_id"]) for p in pending if as_text(p["message_id"]) not in self._held]
        if not lost:
            return []
        log.warning("%s: %d queue entries were delivered but never received (here or by a deposed scheduler); "
                    "handing them out", base_model, len(lost))
        entries = self._client.xclaim(key, self._group, self._queue.consumer, idle_ms, lost)
        return [d for d in (_delivery(entry_id, fields) for entry_id, fields in entries) if d is not None]


def _delivery(entry_id: bytes | str, fields: dict[bytes, bytes] | None) -> Delivery | None:
    if not fields:
        return None
    try:
        return Delivery(as_text(entry_id), decode_request(fields.get(b"req", b"")))
    except CodecError as error:
        log.error("unreadable queue entry %s left pending: %s", as_text(entry_id), error)
        return None

