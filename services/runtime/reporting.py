"""What a scheduler loop reports: the `CompletionHook` seam (request log, checkpoints, usage) and counters.

The loop itself knows no database. It tells a `CompletionHook` when plan items start and finish; the
service wires a database-backed hook (`services.control.recording`), tests may wire none. The hook may
replace a completion's result (a save whose checkpoint row cannot be written fails instead of pointing
the client at a checkpoint nobody can find), and it stores the final results itself, through the loop's
`StoreResults`, before it marks the requests finished: the other order let a poll read "finished" and
then "result no longer available".

`LoopCounters` are written by the loop thread and read from any thread (gateway metrics, healthz): every
access holds a lock and readers get an immutable `RuntimeStats` snapshot. They also feed the base model's
Prometheus series (`services.metrics.ModelSeries`: histograms of queue wait, pass size and duration),
registered on the process registry when the composition root passes one, private otherwise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol, runtime_checkable

from services.control.api import RuntimeStats
from services.domain.sampling import SampleResult
from services.domain.training import WorkError
from services.metrics.series import ModelSeries, RuntimeMetrics
from services.scheduler.requests import Completion, QueuedRequest, SchedulerStats

StoreResults = Callable[[Sequence[Completion]], None]
"""Stores completions' results in the loop's `ResultStore` (idempotent: a retry may store again)."""


@runtime_checkable
class CompletionHook(Protocol):
    """Observes a loop's work. Called on the loop thread; must not block for long."""

    def started(self, requests: Sequence[QueuedRequest], pass_id: str) -> None:
        """`requests` are about to run in the plan item `pass_id`."""
        ...

    def finished(self, completions: Sequence[Completion], pass_id: str | None,
                 store: StoreResults) -> list[Completion]:
        """`completions` ended (pass_id None: refused by the scheduler); returns them, possibly amended.

        Must call `store` with the final completions before it records them as finished where a poll
        reads (before its transaction commits): a poll that sees "finished" then finds the result."""
        ...


class NullCompletionHook:
    """A hook that records nothing (tests, benchmarks)."""

    def started(self, requests: Sequence[QueuedRequest], pass_id: str) -> None:
        return None

    def finished(self, completions: Sequence[Completion], pass_id: str | None,
                 store: StoreResults) -> list[Completion]:
        store(completions)
        return list(completions)


class LoopCpu:
    """The loop thread's CPU time by part (`carpool_scheduler_loop_cpu_seconds_total{part}`).

    Why: with many small requests the loop's own per-request work (bookkeeping, planning) competes with the
    passes for the same thread; this is how an operator, or `bench/service.py`, sees how much. `lap(part)`
    bills the thread's CPU time since the previous lap (or `restart`) to `part`. Thread CPU time is per
    thread, so only the loop's thread may call either, and it restarts at the top of every iteration.
    """

    clock: ClassVar[Callable[[], float]] = time.thread_time
    """The thread's CPU clock (a class attribute, so that tests can drive it)."""

    def __init__(self, series: ModelSeries) -> None:
        self._series = series
        self._last = 0.0

    def restart(self) -> None:
        self._last = LoopCpu.clock()

    def lap(self, part: str) -> None:
        now = LoopCpu.clock()
        self._series.loop_cpu(part, now - self._last)
        self._last = now


class LoopCounters:
    """Totals since the loop was built; thread-safe (but `cpu`, which only the loop's thread uses)."""

    def __init__(self, base_model: str, series: ModelSeries | None = None) -> None:
        self._base_model = base_model
        self.series = series or RuntimeMetrics(None).for_model(base_model)
        self.cpu = LoopCpu(self.series)
        self._lock = threading.Lock()
        self._passes = 0
        self._multi_tenant_passes = 0
        self._tenants_total = 0
        self._tokens = 0
        self._barriers = 0
        self._sample_batches = 0
        self._completed = 0
        self._failed = 0
        self._last_tokens_per_s = 0.0
        self._busy_s = 0.0
        self._queued = 0

    def record_started(self, requests: Sequence[QueuedRequest]) -> None:
        """Requests start running: their queue wait is over."""
        self.series.started((r.kind.value, r.enqueued_at) for r in requests)

    def record_pass(self, tokens: int, tenants: int, seconds: float, adapters: int = 0) -> float:
        """Count one packed pass; returns its tokens per second."""
        rate = tokens / seconds if seconds > 0 else 0.0
        self.series.packed_pass(tokens=tokens, adapters=adapters, tenants=tenants, seconds=seconds)
        with self._lock:
            self._passes += 1
            self._tenants_total += tenants
            self._multi_tenant_passes += int(tenants > 1)
            self._tokens += tokens
            self._last_tokens_per_s = rate
            self._busy_s += seconds
        return rate

    def record_barrier(self, seconds: float, kind: str = "barrier") -> None:
        self.series.barrier(kind)
        with self._lock:
            self._barriers += 1
            self._busy_s += seconds

    def record_sample_batch(self, seconds: float, tokens: int = 0) -> None:
        self.series.sampled(tokens)
        with self._lock:
            self._sample_batches += 1
            self._busy_s += seconds

    def record_completions(self, completions: Sequence[Completion]) -> None:
        failed = sum(c.is_error for c in completions)
        for c in completions:
            result = c.result
            category = result.category if isinstance(result, WorkError) else None
            tokens = (sum(len(s.tokens) for s in result.sequences) if isinstance(result, SampleResult)
                      else c.request.num_tokens)
            self.series.finished(c.request.tenant_id, c.request.kind.value, category, tokens)
        with self._lock:
            self._completed += len(completions) - failed
            self._failed += failed

    def record_scheduler(self, stats: SchedulerStats, queue_depth: int) -> None:
        """Take the scheduler's gauges (only the loop thread may ask the scheduler)."""
        with self._lock:
            self._queued = queue_depth + sum(stats.queued_by_tenant.values())
        self.series.queue(self._queued)

    def snapshot(self, running: bool) -> RuntimeStats:
        with self._lock:
            return RuntimeStats(
                base_model=self._base_model,
                running=running,
                passes=self._passes,
                multi_tenant_passes=self._multi_tenant_passes,
                tenants_per_pass_total=self._tenants_total,
                tokens=self._tokens,
                barriers=self._barriers,
                sample_batches=self._sample_batches,
                requests_completed=self._completed,
                requests_failed=self._failed,
                last_pass_tokens_per_s=self._last_tokens_per_s,
                busy_seconds=self._busy_s,
                queued=self._queued,
            )
