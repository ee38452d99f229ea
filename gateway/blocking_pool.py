"""`FairBlockingPool`: the gateway's bounded executor for blocking control-plane work, shared fairly by callers.

Database transactions, API-key lookups, queue reads and file copies of the control plane are synchronous;
the async API runs them with `asyncio.to_thread`, i.e. on the event loop's *default executor*. Python's
default is a FIFO pool: a tenant that floods the gateway with cheap calls fills its queue, and every other
tenant's next call waits behind the whole flood. The gateway's lifespan installs this pool as the event
loop's default executor instead:

- at most `threads` threads ever run (setting `blocking_threads`); more work waits in the pool, it never
  starts more threads;
- waiting work is kept per caller (`CURRENT_CALLER`: the edge middleware's credential digest, else the
  client address) and free threads take the callers' work round robin, so one caller's backlog delays
  another caller's call by at most one call per busy caller, not by the backlog.

The forward_backward body decoding keeps its own pool (`gateway.edge_limits.DecodePool`).
"""

from __future__ import annotations

import contextvars
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

CURRENT_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("carpool_caller", default="")
"""Who the blocking work submitted from this context is for (set per request by the edge middleware)."""


@dataclass
class _Job:
    future: Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class FairBlockingPool(ThreadPoolExecutor):
    """An executor of at most `threads` threads serving callers round robin.

    A `ThreadPoolExecutor` only by type (asyncio's `set_default_executor` demands one): it overrides
    every method that queues or runs work with its own per-caller queues and workers."""

    def __init__(self, threads: int, *, name: str = "carpool-blocking") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        super().__init__(max_workers=threads, thread_name_prefix=name)
        self.threads = threads
        self._name = name
        self._cond = threading.Condition()
        self._waiting: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._workers: list[threading.Thread] = []
        self._idle = 0
        """Workers waiting for a job."""
        self._count = 0
        """Jobs waiting for a worker."""
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:  # type: ignore[override]
        job = _Job(Future(), fn, args, kwargs)
        with self._cond:
            if self._closed:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._waiting.setdefault(CURRENT_CALLER.get(), deque()).append(job)
            self._count += 1
            if self._count > self._idle and len(self._workers) < self.threads:
                self._start_worker()  # more work than idle workers, and room for one more
            self._cond.notify()
        return job.future

    def waiting(self) -> int:
        """Jobs submitted and not yet started."""
        with self._cond:
            return self._count

    def started_threads(self) -> int:
        with self._cond:
            return len(self._workers)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._closed = True
            if cancel_futures:
                for jobs in self._waiting.values():
                    for job in jobs:
                        job.future.cancel()
                self._waiting.clear()
                self._count = 0
            self._cond.notify_all()
            workers = list(self._workers)
        if wait:
            for worker in workers:
                worker.join()

    def _start_worker(self) -> None:
        worker = threading.Thread(target=self._work, name=f"{self._name}-{len(self._workers)}", daemon=True)
        self._workers.append(worker)
        worker.start()

    def _next(self) -> _Job | None:
        """Under the lock: the first waiting caller's oldest job (that caller goes to the back), or None once
        shut down with nothing left."""
        while not self._waiting:
            if self._closed:
                return None
            self._idle += 1
            self._cond.wait()
            self._idle -= 1
        caller, jobs = next(iter(self._waiting.items()))
        job = jobs.popleft()
        self._count -= 1
        del self._waiting[caller]
        if jobs:
            self._waiting[caller] = jobs  # re-inserted last: the other callers go first
        return job

    def _work(self) -> None:
        while True:
            with self._cond:
                job = self._next()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                result = job.fn(*job.args, **job.kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
