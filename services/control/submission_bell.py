"""`SubmissionBell`: wakes the batched sampling poller of a sampling session when a sample is submitted here.

`retrieve_futures` holds a poll while its target has nothing to report. With requests in flight it waits on
their completions (the notifier); with none in flight it can only wait for a new submission, and it used to
look at the database every 50 ms for one — two transactions per look, dozens per sample for a client that
samples one request at a time. A submission through this process now rings the session's bell, so an idle
poll waits on the bell and looks again only every `RECHECK_S` (a submission through another gateway process
is seen on that recheck; one that is not even queued yet cannot have finished, so nothing is reported late
by more than the recheck).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from services.jobqueue.memory import resolve_all_threadsafe


class SubmissionBell:
    """Per-key one-shot wake-ups: `wait(key)` returns True when `ring(key)` comes first, False on timeout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # rung and awaited on the gateway's loop; tests drive several loops
        self._waiters: dict[str, list[asyncio.Future[bool]]] = {}

    def ring(self, key: str) -> None:
        """Wake every poll waiting on `key` now (a later wait is not woken by this ring)."""
        with self._lock:
            waiters = self._waiters.pop(key, [])
        resolve_all_threadsafe(waiters)

    async def wait(self, key: str, timeout_s: float) -> bool:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiters.setdefault(key, []).append(future)
        try:
            return await asyncio.wait_for(future, max(0.0, timeout_s))
        except TimeoutError:
            return False
        finally:
            self._discard(key, future)

    def waiting(self) -> int:
        with self._lock:
            return sum(len(futures) for futures in self._waiters.values())

    def _discard(self, key: str, future: asyncio.Future[bool]) -> None:
        with self._lock:
            futures = self._waiters.get(key)
            if futures is None:
                return
            with contextlib.suppress(ValueError):
                futures.remove(future)
            if not futures:
                del self._waiters[key]
