"""Finished items whose bookkeeping could not be written: kept, retried, and their queue entries held.

The loop's completion hook marks an item's requests finished in the database (with usage and checkpoint
rows). When it fails for good (`RetryingHook` gave up after a PostgreSQL outage of five minutes, say), the
client still gets its result: the loop stores and announces it. What it must not do is acknowledge the
queue entries as if nothing were missing. Before, it did, and the request rows stayed unfinished; a
scheduler taking over later positions each model at its lowest unfinished request whose result is not
stored, and an answered result is kept only 120 s, so after that it waited for a request no client would
send again, and the run stalled.

Now such an item waits here with its queue entries unacknowledged:

* while this loop lives, it records the item again every `retry_s` (doubling up to `max_retry_s` while it
  keeps failing), oldest first, and acknowledges the entries once it succeeds. The hook's transitions are
  conditional, so recording an item twice marks nothing twice;
* if the loop dies first, the entries are still pending on the queue, and a successor claims them again.
  The successor positions the model at the unfinished request and runs it: the replica that ran it answers
  it from memory (`services.runtime.replica_executor`), or the journal's restore does, so it is not applied
  twice. Then its bookkeeping is written as usual.

The backlog is bounded (`limit` items): past it, the oldest item's entries are acknowledged as before (an
outage that long is logged as an error, item by item).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.scheduler.requests import Completion

log = logging.getLogger(__name__)

DEFAULT_RETRY_S = 5.0
DEFAULT_MAX_RETRY_S = 60.0
DEFAULT_LIMIT = 10_000


@dataclass(frozen=True)
class UnrecordedItem:
    """An item delivered to its clients whose bookkeeping is still to be written."""

    completions: Sequence[Completion]
    pass_id: str | None
    delivery_ids: Sequence[str]
    """Its queue entries, acknowledged only once the item is recorded."""


class UnrecordedBacklog:
    """Items waiting for their bookkeeping, oldest first; not thread-safe (the loop's thread owns it)."""

    def __init__(self, *, retry_s: float = DEFAULT_RETRY_S, max_retry_s: float = DEFAULT_MAX_RETRY_S,
                 limit: int = DEFAULT_LIMIT, clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self._items: deque[UnrecordedItem] = deque()
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        self._limit = limit
        self._clock = clock
        self._delay_s = retry_s
        self._next_try = 0.0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: UnrecordedItem) -> list[UnrecordedItem]:
        """Keep `item`; returns the oldest items pushed out past the limit (their entries are to be acked)."""
        if not self._items:
            self._delay_s = self._retry_s
            self._next_try = self._clock() + self._retry_s
        self._items.append(item)
        dropped = []
        while len(self._items) > self._limit:
            dropped.append(self._items.popleft())
        for old in dropped:
            log.error("bookkeeping of %d requests (%s) still not written; their queue entries are acknowledged "
                      "without it", len(old.completions), old.pass_id or "refusals")
        return dropped

    def due(self) -> bool:
        return bool(self._items) and self._clock() >= self._next_try

    def retry(self, record: Callable[[UnrecordedItem], object]) -> list[UnrecordedItem]:
        """Record items oldest first until one fails (its error is logged and the next try backs off); returns
        the items recorded, whose entries may now be acknowledged."""
        recorded: list[UnrecordedItem] = []
        while self._items:
            item = self._items[0]
            try:
                record(item)
            except Exception:  # noqa: BLE001 - the loop carries on; the item waits for the next try
                self._next_try = self._clock() + self._delay_s
                log.warning("bookkeeping of %d unrecorded items still fails; next try in %.0f s", len(self._items),
                            self._delay_s, exc_info=True)
                self._delay_s = min(self._delay_s * 2, self._max_retry_s)
                break
            recorded.append(self._items.popleft())
        if not self._items:
            self._delay_s = self._retry_s
        return recorded
