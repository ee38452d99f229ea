"""`AcceptedRequests`: who owns the requests this process accepted recently and whose results nobody collected.

A `retrieve_future` must check that the request belongs to the caller and know its kind (to shape the
result); both are immutable once the request is logged. The SDK polls a request right after submitting
it, through the same process, so remembering them at submission spares that first poll a database read
— which would otherwise run on a worker thread while the request's pass runs and compete with it for the
GIL. Entries are dropped once a final answer was given, after `max_age_s`, and oldest first beyond
`max_entries`; a miss (another gateway process, a restart, an old request) just reads the request log.

Only requests whose answer will come from the result store belong here: a remembered request without a
stored result is waited for rather than answered from its row, so an entry must not outlive its result
(`max_age_s` is far below the results' TTL).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_ENTRIES = 100_000
DEFAULT_MAX_AGE_S = 600.0


@dataclass(frozen=True)
class AcceptedRequest:
    tenant_id: str
    kind: str
    """The request log's kind (`forward_backward`, `sample`, ...)."""
    accepted_at: float
    keeps_result: bool = False
    """Its stored result must outlive its answer: a sample recorded for `stable_reinforce`, which reads it
    from the result store later (`services.control.stability`)."""


class AcceptedRequests:
    """A bounded map request id → (tenant, kind); thread-safe (the gateway may call from worker threads)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_age_s: float = DEFAULT_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max_entries = max_entries
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, AcceptedRequest] = OrderedDict()

    def add(self, request_id: str, tenant_id: str, kind: str, *, keeps_result: bool = False) -> None:
        now = self._clock()
        with self._lock:
            self._entries[request_id] = AcceptedRequest(tenant_id, kind, now, keeps_result)
            self._entries.move_to_end(request_id)
            self._trim(now)

    def get(self, request_id: str) -> AcceptedRequest | None:
        """The entry if it is known and young enough, else None."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.accepted_at < self._clock() - self._max_age_s:
                return None
            return entry

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._entries.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _trim(self, now: float) -> None:
        """Drop the oldest entries beyond the size bound, and expired ones (insertion order = age order)."""
        cutoff = now - self._max_age_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if len(self._entries) <= self._max_entries and oldest.accepted_at >= cutoff:
                return
            self._entries.popitem(last=False)
