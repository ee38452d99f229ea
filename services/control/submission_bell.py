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

from services.jobqueue.memory import KeyedWaiters, resolve_all_threadsafe


class SubmissionBell:
    """Per-key one-shot wake-ups: `wait(key)` returns True when `ring(key)` comes first, False on timeout."""

    def __init__(self) -> None:
        self._waiters = KeyedWaiters()  # rung and awaited on the gateway's loop; tests drive several loops

    def ring(self, key: str) -> None:
        """Wake every poll waiting on `key` now (a later wait is not woken by this ring)."""
        resolve_all_threadsafe(self._waiters.take([key]))

    async def wait(self, key: str, timeout_s: float) -> bool:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.park(key, future)
        try:
            return await asyncio.wait_for(future, max(0.0, timeout_s))
        except TimeoutError:
            return False
        finally:
            self._waiters.discard(key, future)

    def waiting(self) -> int:
        return self._waiters.count()
