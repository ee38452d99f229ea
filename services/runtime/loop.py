"""`SchedulerLoop`: the thread that drives one base model's `Backend` from the work queue.

    claim (WorkQueue) ─▶ Scheduler.submit ─▶ Scheduler.step ─▶ Dispatcher (barriers, packed passes,
    sample batches) ─▶ Scheduler.complete ─▶ CompletionHook (ResultStore.put, then "done")
    ─▶ Notifier.publish ─▶ ack

One loop owns one `Scheduler` (which is not thread-safe by design) and one backend. Results are stored
before their requests are logged finished (the hook stores them through the loop before it commits: a
poll that reads "done" finds the result), announced after that, and queue entries acked last, so a
crash in between redelivers work instead of losing it; an item whose bookkeeping fails keeps its entries
unacknowledged until a retry writes it (`services.runtime.unrecorded`). Markers (`CONSUMED`) and duplicate
deliveries produce no result of their own and are acked at once. Nothing that goes wrong in one iteration stops
the loop: backend failures become error results (see `dispatch`), anything else is logged and the loop
carries on. The thread's CPU time is billed to the backend's calls and to the work around them
(`reporting.LoopCpu`, `carpool_scheduler_loop_cpu_seconds_total`).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.control.api import RuntimeStats
from services.domain.backend import Backend
from services.jobqueue.protocol import (
    DEFAULT_RESULT_TTL_S,
    Delivery,
    Notifier,
    ResultStore,
    StoredResult,
    WorkQueue,
)
from services.metrics.series import RuntimeMetrics
from services.runtime.dispatch import Dispatcher
from services.runtime.reporting import CompletionHook, LoopCounters, NullCompletionHook
from services.runtime.unrecorded import UnrecordedBacklog, UnrecordedItem
from services.scheduler.requests import Completion, PlanItem, QueuedRequest, RequestId, RequestKind
from services.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopConfig:
    poll_s: float = 0.2
    """How long an idle loop waits for work per claim; also bounds how long `stop()` takes to notice."""
    batch_window_s: float = 0.005
    """After work that packs (passes, samples) arrives, wait this long for more before planning, so
    near-simultaneous requests of several tenants share a pass or sample batch. Adds at most this much
    latency to a request. Not for barriers alone, nor while the scheduler holds (`_window_pays`)."""
    batch_window_lookback_s: float | None = 1.0
    """The window applies only while requests of at least two tenants arrived within this many seconds
    (counting the ones just claimed); a lone tenant's work is planned at once. None: always apply it."""
    max_claim: int = 512
    """Queue entries taken per claim."""
    result_ttl_s: float = DEFAULT_RESULT_TTL_S
    unrecorded_retry_s: float = 5.0
    """How soon an item whose bookkeeping failed is recorded again (doubling up to a minute while it fails;
    `services.runtime.unrecorded`)."""


class SchedulerLoop:
    """Drives one base model; `start()` runs it on a daemon thread, `stop()` ends it gracefully."""

    def __init__(
        self,
        base_model: str,
        backend: Backend,
        queue: WorkQueue,
        results: ResultStore,
        notifier: Notifier,
        *,
        scheduler: Scheduler | None = None,
        hook: CompletionHook | None = None,
        config: LoopConfig | None = None,
        metrics: RuntimeMetrics | None = None,
    ) -> None:
        self.base_model = base_model
        self._queue = queue
        self._results = results
        self._notifier = notifier
        self._scheduler = scheduler or Scheduler()
        self._hook = hook or NullCompletionHook()
        self._config = config or LoopConfig()
        # `metrics`: the process's series (registered on its /metrics); None keeps them private to the loop.
        self._counters = LoopCounters(base_model, metrics.for_model(base_model) if metrics else None)
        self._dispatcher = Dispatcher(backend, self._counters, base_model)
        self._deliveries: dict[RequestId, list[str]] = {}
        self._unrecorded = UnrecordedBacklog(retry_s=self._config.unrecorded_retry_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Pass ids join the request log with pass logs; the prefix tells loops (and restarts) apart.
        self._pass_prefix = f"pass-{secrets.token_hex(4)}"
        self._iterations = itertools.count()
        self._hold_until: float | None = None
        lookback = self._config.batch_window_lookback_s
        self._activity = TenantActivity(lookback) if lookback is not None else None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self.running:
            return
        recovered = self._queue.recover(self.base_model)
        if recovered:
            log.info("%s: re-queued %d unacknowledged requests", self.base_model, recovered)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"scheduler:{self.base_model}", daemon=True)
        self._thread.start()
        log.info("%s: scheduler loop started", self.base_model)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the current iteration (whatever runs completes and is delivered), then end the thread. Items
        whose bookkeeping is still unwritten keep their entries unacknowledged, for the next loop to claim."""
        thread = self._thread
        self._stop.set()
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("%s: scheduler loop did not stop within %.0f s", self.base_model, timeout_s)
        self._thread = None
        log.info("%s: scheduler loop stopped", self.base_model)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def unrecorded(self) -> int:
        """Items delivered whose bookkeeping is still to be written (their queue entries are held)."""
        return len(self._unrecorded)

    def stats(self) -> RuntimeStats:
        """A snapshot of the counters; safe from any thread."""
        return self._counters.snapshot(self.running)

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self._scheduler.has_queued()
                self.run_once(self._held_wait() if busy else self._config.poll_s)
            except Exception:  # noqa: BLE001 - the loop must outlive any single failure
                log.exception("%s: scheduler loop iteration failed; carrying on", self.base_model)
                self._stop.wait(self._config.poll_s)  # no hot spin if the failure repeats

    def run_once(self, wait_s: float = 0.0) -> int:
        """One iteration: claim, plan, run and deliver. Returns how many items and refusals it handled.

        Public so that tests and tools can drive a loop synchronously without its thread.
        """
        cpu = self._counters.cpu
        cpu.restart()
        if self._unrecorded.due():
            self._record_backlog()
            cpu.lap("bookkeeping")
        for delivery in self._claim(wait_s):
            self._admit(delivery)
        plan = self._scheduler.step()
        self._hold_until = None if plan.hold_s is None else time.monotonic() + plan.hold_s
        cpu.lap("planning")
        self._deliver(list(plan.rejected), None)
        cpu.lap("bookkeeping")
        for item in plan.items:
            self._execute(item)
        self._counters.record_scheduler(self._scheduler.stats(), self._queue.depth(self.base_model))
        cpu.lap("planning")
        return len(plan.items) + len(plan.rejected)

    def _held_wait(self) -> float:
        """While the scheduler holds an item for tenants expected soon: wait for new work until then."""
        return 0.0 if self._hold_until is None else max(0.0, self._hold_until - time.monotonic())

    def _claim(self, wait_s: float) -> list[Delivery]:
        claimed = self._queue.claim(self.base_model, self._config.max_claim, wait_s)
        if claimed and self._window_pays(claimed):
            time.sleep(self._config.batch_window_s)
            late = self._queue.claim(self.base_model, self._config.max_claim, 0.0)
            self._others_active(late)  # remember who came late, too
            claimed += late
        return claimed

    def _window_pays(self, claimed: Sequence[Delivery]) -> bool:
        """Whether waiting out the batch window may put more tenants into what `claimed` starts: only for work
        that packs (a barrier runs alone for its model), only while another tenant is active, and not while
        the scheduler holds for arrivals it predicts (a held step is planned again as each one comes, so the
        window would only delay the item that the last arrival completes)."""
        others = self._others_active(claimed)  # noted on every claim, so the lookback sees every tenant
        return (others and self._config.batch_window_s > 0 and self._held_wait() == 0.0
                and any(d.request.kind.packs for d in claimed) and not self._stop.is_set())

    def _others_active(self, claimed: Sequence[Delivery]) -> bool:
        """Note the claimed requests' tenants; whether a batch window may gather requests of others."""
        if self._activity is None:
            return True
        return self._activity.note((d.request.tenant_id for d in claimed), time.monotonic()) >= 2

    def _admit(self, delivery: Delivery) -> None:
        request = delivery.request
        admission = self._scheduler.submit(request)
        if admission.unrecorded:
            self._record_ran(request, delivery.delivery_id)
            return
        if request.kind is RequestKind.CONSUMED or not admission.is_new:
            # A marker or a redelivered duplicate: the original request owns the result.
            self._queue.ack(self.base_model, [delivery.delivery_id])
            return
        self._deliveries.setdefault(admission.request_id, []).append(delivery.delivery_id)

    def _execute(self, item: PlanItem) -> None:
        """Run one plan item, billing the thread's CPU to the backend's call or to the work around it."""
        cpu = self._counters.cpu
        pass_id = f"{self._pass_prefix}-{item.item_id}"
        self._notify_started(item.requests, pass_id)
        cpu.lap("bookkeeping")
        results = self._dispatcher.run(item)  # bills the backend's call to its part
        completions = self._scheduler.complete(item, results)
        cpu.lap("planning")
        self._deliver(completions, pass_id)
        cpu.lap("bookkeeping")

    def _notify_started(self, requests: Sequence[QueuedRequest], pass_id: str) -> None:
        self._counters.record_started(requests)
        try:
            self._hook.started(requests, pass_id)
        except Exception:  # noqa: BLE001 - bookkeeping must not stop the work
            log.exception("%s: completion hook failed on start of %s", self.base_model, pass_id)

    def _deliver(self, completions: Sequence[Completion], pass_id: str | None) -> None:
        """Record (the hook stores the results before it marks the requests finished), announce, then ack."""
        if not completions:
            return
        final, recorded = self._record(completions, pass_id)
        self._notifier.publish_many([completion.request_id for completion in final])
        delivered = [d for c in final for d in self._deliveries.pop(c.request_id, [])]
        if recorded:
            self._ack(delivered)
        else:  # the clients have their results; the entries wait until the bookkeeping is written
            self._ack(d for item in self._unrecorded.add(UnrecordedItem(final, pass_id, delivered))
                      for d in item.delivery_ids)
        self._counters.record_completions(final)

    def _ack(self, delivery_ids: Iterable[str]) -> None:
        ids = list(delivery_ids)
        if ids:
            self._queue.ack(self.base_model, ids)

    def _record_ran(self, request: QueuedRequest, delivery_id: str) -> None:
        """A request a predecessor ran and answered but did not record: its bookkeeping from the stored result
        (gone meanwhile: nothing to record from), then its entry is acked (or held, if that fails too)."""
        stored = self._results.get_nowait(request.request_id)
        if stored is None:
            self._ack([delivery_id])
            return
        item = UnrecordedItem([Completion(request, stored.value)], None, [delivery_id])
        try:
            self._hook.finished(item.completions, None, lambda _final: None)  # the client has its result
        except Exception:  # noqa: BLE001 - held and retried like any other unrecorded item
            log.exception("%s: bookkeeping of %s failed again", self.base_model, request.request_id)
            self._ack(d for old in self._unrecorded.add(item) for d in old.delivery_ids)
            return
        self._ack([delivery_id])

    def _record_backlog(self) -> None:
        def record(item: UnrecordedItem) -> None:
            self._hook.finished(item.completions, item.pass_id, self._store)

        recorded = self._unrecorded.retry(record)
        self._ack(d for item in recorded for d in item.delivery_ids)
        if recorded:
            log.info("%s: bookkeeping of %d items written late", self.base_model, len(recorded))

    def _record(self, completions: Sequence[Completion], pass_id: str | None) -> tuple[list[Completion], bool]:
        """The hook's final completions, whose results are stored by the time it returns, and whether the
        hook wrote their bookkeeping."""
        stored: list[Sequence[Completion]] = []
        recorded = True

        def store(final: Sequence[Completion]) -> None:
            self._store(final)
            stored.append(final)

        try:
            amended = list(self._hook.finished(completions, pass_id, store))
        except Exception:  # noqa: BLE001 - the client must get its result even if bookkeeping failed
            log.exception("%s: completion hook failed for %s; its queue entries are held until it is written",
                          self.base_model, pass_id or "refusals")
            amended = list(stored[-1]) if stored else list(completions)  # what a poll may have read already
            recorded = False
        if len(amended) != len(completions):
            log.error("%s: completion hook returned %d of %d completions; using the originals",
                      self.base_model, len(amended), len(completions))
            amended = list(completions)
        if not stored or not _same(stored[-1], amended):
            self._store(amended)  # a hook that did not store (or stored something else): store what counts
        return amended, recorded

    def _store(self, completions: Sequence[Completion]) -> None:
        for completion in completions:
            self._results.put(completion.request_id, StoredResult.from_completion(completion),
                              self._config.result_ttl_s)


def _same(a: Sequence[Completion], b: Sequence[Completion]) -> bool:
    return len(a) == len(b) and all(x.request is y.request and x.result is y.result for x, y in zip(a, b, strict=True))


class TenantActivity:
    """When each tenant last had work claimed; answers how many were active within `lookback_s`."""

    def __init__(self, lookback_s: float) -> None:
        self._lookback_s = lookback_s
        self._last_seen: dict[str, float] = {}

    def note(self, tenants: Iterable[str], now: float) -> int:
        """Record `tenants` as active at `now`; returns how many tenants were active within the lookback."""
        for tenant in tenants:
            self._last_seen[tenant] = now
        cutoff = now - self._lookback_s
        # Forget the idle ones: the dict stays as small as the set of recently active tenants.
        for tenant in [t for t, seen in self._last_seen.items() if seen < cutoff]:
            del self._last_seen[tenant]
        return len(self._last_seen)
