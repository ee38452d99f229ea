"""`FairBlockingPool` (issue 16): never more than its threads, and one caller's backlog does not hold up
another caller's call (served round robin). Synchronised with events only: nothing here depends on timing."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait

from gateway.blocking_pool import CURRENT_CALLER, FairBlockingPool


def _submit_as(pool: FairBlockingPool, caller: str, fn: Callable[[], object]) -> Future[object]:
    context = contextvars.copy_context()
    context.run(CURRENT_CALLER.set, caller)
    return context.run(pool.submit, fn)


def test_a_saturated_pool_queues_work_instead_of_starting_threads() -> None:
    pool = FairBlockingPool(2, name="bound-test")
    gate = threading.Event()
    try:
        futures = [_submit_as(pool, "flood", gate.wait) for _ in range(10)]
        assert pool.started_threads() == 2
        assert pool.waiting() >= 8
        assert sum(t.name.startswith("bound-test") for t in threading.enumerate()) == 2
        gate.set()
        done, _ = wait(futures)
        assert all(f.result() is True for f in done)
        assert pool.started_threads() == 2 and pool.waiting() == 0
    finally:
        gate.set()
        pool.shutdown()


def test_another_callers_call_runs_before_a_floods_backlog() -> None:
    pool = FairBlockingPool(1, name="fair-test")
    gate, order = threading.Event(), []
    try:
        first = _submit_as(pool, "flood", gate.wait)
        backlog = [_submit_as(pool, "flood", lambda i=i: order.append(f"flood-{i}")) for i in range(5)]
        other = _submit_as(pool, "quiet", lambda: order.append("quiet"))
        gate.set()
        wait([first, *backlog, other])
        assert order.index("quiet") <= 1, order  # FIFO would run it last, after the whole flood
        assert [o for o in order if o != "quiet"] == [f"flood-{i}" for i in range(5)]  # each caller in order
    finally:
        gate.set()
        pool.shutdown()


def test_an_exception_reaches_the_caller_and_the_worker_carries_on() -> None:
    pool = FairBlockingPool(1, name="error-test")
    try:
        failing = pool.submit(lambda: 1 / 0)
        assert isinstance(failing.exception(), ZeroDivisionError)
        assert pool.submit(lambda: 42).result() == 42
    finally:
        pool.shutdown()
