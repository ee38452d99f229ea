"""What the scheduler remembers about each tenant's backlog between steps, kept so no step has to scan it all.

`Outstanding` counts, per tenant, the requests admitted and not yet completed (queued, early or in flight).
Whenever an item completes, the arrival forecast must know whether each of its tenants has anything left in
the scheduler (if not, its next request comes from its client's turnaround). That used to be found by
collecting the tenants of every queued, early and in-flight request on each completion: O(pending) per
completed item, and a barrier is an item of its own, so O(tenants) per `optim_step`. At 512 closed-loop
tenants that was ~60 µs of every request's ~110 µs in the scheduler (`services/scheduler/simulation.py`,
the loop thread in py-spy: `_note_completed`); the count answers in O(1).

`PassWork` is the contention memory behind pacing: per tenant with pass work lately, its queued pass tokens
when last seen with some, and when. A tenant counts as contending for `window_s` after that.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from services.scheduler.requests import QueuedRequest, TenantId


class Outstanding:
    """Per tenant: requests admitted and not completed yet. Tenants with none are not kept."""

    def __init__(self) -> None:
        self._counts: dict[TenantId, int] = {}

    def add(self, tenant: TenantId) -> None:
        self._counts[tenant] = self._counts.get(tenant, 0) + 1

    def remove(self, tenants: Iterable[TenantId]) -> None:
        """One request of each of `tenants` (repeats count) completed or was dropped."""
        for tenant in tenants:
            left = self._counts.get(tenant, 0) - 1
            if left > 0:
                self._counts[tenant] = left
            else:
                self._counts.pop(tenant, None)

    def has(self, tenant: TenantId) -> bool:
        return tenant in self._counts

    def __len__(self) -> int:
        """Tenants with something outstanding."""
        return len(self._counts)


def queued_tokens(runs: Sequence[Sequence[QueuedRequest]]) -> Counter[TenantId]:
    """Queued pass tokens per tenant, over the runs (each one model's, so one tenant's) of a step."""
    queued: Counter[TenantId] = Counter()
    for run in runs:
        if run:
            queued[run[0].tenant_id] += sum(r.num_tokens for r in run)
    return queued


class PassWork:
    """Tenants with pass work within the last `window_s`: (queued pass tokens when last seen, when)."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._seen: dict[TenantId, tuple[int, float]] = {}

    def note(self, queued: Counter[TenantId], now: float) -> None:
        """Remember each tenant's queued pass tokens; forget tenants without pass work for a while."""
        for tenant, tokens in queued.items():
            self._seen[tenant] = (tokens, now)
        self._seen = {t: seen for t, seen in self._seen.items() if now - seen[1] <= self._window_s}

    def contended(self) -> bool:
        return len(self._seen) >= 2

    def smallest(self) -> int:
        """The least queued pass work of a contending tenant (0 when none is remembered)."""
        return min((tokens for tokens, _ in self._seen.values()), default=0)

    def alike_tokens(self, latency_factor: float) -> float | None:
        """While tenants contend: the most queued pass work of a tenant about the size of the smallest one
        (within the latency factor); more is a heavy backlog, what pacing is for. None: no contention."""
        if not self.contended():
            return None
        return max(1.0, latency_factor) * self.smallest()

    def any_above(self, tokens: float) -> bool:
        """Whether a remembered tenant had more than `tokens` queued (a heavy backlog beside light ones)."""
        return any(seen > tokens for seen, _ in self._seen.values())
