"""Arrival forecasts: when an active tenant's next request is about to reach the scheduler, and the hold
decision built on them (whether the next pass or sample batch should wait for it).

Why: independent closed-loop clients never arrive together. After a pass its tenants go off to fetch
their results and send their `optim_step`; the next pass takes whoever happens to be queued, so eight
tenants end up spread over several small passes (measured: 1.5-2.1 tenants per pass), each paying the
pass's fixed cost and per-item bookkeeping. A client's turnaround (from its result being published to its
next request arriving: long-poll wake-up, HTTP, SDK) is regular, so the scheduler can tell when a tenant
that is not queued now is due, and hold the pass for it while that pays. Once tenants share a pass they
get their results together and come back together: the hold turns independent clients into lock-step
ones without Tinker's fixed clock cycles.

`ArrivalForecast` learns per tenant the gap between an item of one kind completing (with nothing of the
tenant left queued) and the tenant's next request of another kind arriving, as a median of recent gaps.
A tenant is *expected* in a lane (passes or sampling) when it was active in that lane lately, has nothing
queued there now, and its predicted arrival has not passed by more than a slack (a tenant that stops or
thinks for long is late, and nobody waits for it again until it sends something).

`decide_hold` is the policy: hold only while at least one other tenant than the queued ones is expected
(so a lone tenant is never held: work-conserving), only for tenants predicted within the hold budget (a
multiple of the item's fixed cost, set by the scheduler: waiting w for a tenant pays while w is below the
fixed cost of the item it would otherwise need), and never longer than the budget from when the hold began.
Pure: times are handed in; no clock, no I/O.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from services.scheduler.requests import RequestKind, TenantId

PASS, BARRIER, SAMPLE = "pass", "barrier", "sample"
"""What completed or arrived, as far as forecasting goes: every barrier kind behaves alike."""


def kind_class(kind: RequestKind) -> str:
    if kind.is_pass:
        return PASS
    return SAMPLE if kind is RequestKind.SAMPLE else BARRIER


@dataclass
class _Track:
    """One tenant: when it last arrived per class, when it went idle (and after what), its gaps."""

    last_arrival: dict[str, float] = field(default_factory=dict)
    idle_since: float | None = None
    idle_after: str = PASS
    gaps: dict[tuple[str, str], deque[float]] = field(default_factory=dict)
    follows: dict[str, deque[str]] = field(default_factory=dict)
    """Per completed class, the classes that arrived next (which request a client sends after a result)."""


class ArrivalForecast:
    """Per-tenant turnaround history and the predicted next arrival of a pass or a sampling request."""

    def __init__(self, active_window_s: float = 5.0, history: int = 8, slack: float = 1.0,
                 min_slack_s: float = 0.002) -> None:
        self._window = active_window_s
        self._history = history
        self._slack = slack
        """A tenant is waited for until its prediction plus this fraction of its turnaround: 1 keeps tenants
        whose turnaround doubles on a loaded machine (simulated: 7.6 instead of 7.2 tenants per pass at
        ±90 % jitter, 8 tenants), while the hold budget still bounds the wait."""
        self._min_slack = min_slack_s
        self._tracks: dict[TenantId, _Track] = {}
        self._everyone = _Track()
        """Every tenant's gaps together: the prior for a tenant without history of its own (clients of one
        service mostly run the same SDK over the same network, so a new tenant is predictable at once)."""

    def arrived(self, tenant: TenantId, kind: RequestKind, now: float) -> None:
        """A request of `tenant` reached the scheduler (first delivery only)."""
        track = self._tracks.setdefault(tenant, _Track())
        arrived = kind_class(kind)
        if track.idle_since is not None:
            gap = max(0.0, now - track.idle_since)
            for history in (track, self._everyone):
                history.gaps.setdefault((track.idle_after, arrived), deque(maxlen=self._history)).append(gap)
                history.follows.setdefault(track.idle_after, deque(maxlen=self._history)).append(arrived)
            track.idle_since = None
        track.last_arrival[arrived] = now

    def completed(self, tenant: TenantId, kind: RequestKind, now: float, *, idle: bool) -> None:
        """An item with `tenant`'s request of `kind` completed; `idle`: nothing of the tenant is left
        queued or in flight, so its next request comes from its client's turnaround."""
        track = self._tracks.get(tenant)
        if track is None:
            return
        if idle:
            track.idle_since, track.idle_after = now, kind_class(kind)
        else:
            track.idle_since = None

    def forget_idle(self, now: float) -> None:
        """Drop tenants with no arrival within the active window (an idle tenant costs nothing)."""
        cutoff = now - self._window
        self._tracks = {t: tr for t, tr in self._tracks.items() if max(tr.last_arrival.values()) >= cutoff}

    def expected(self, lane: str, now: float, *, ready: Iterable[TenantId],
                 barrier_pending: Iterable[TenantId] = ()) -> dict[TenantId, Expected]:
        """Predicted arrivals of `lane`'s (PASS or SAMPLE) next requests of active tenants.

        `ready`: tenants with `lane` work queued now (not expected: they are here). `barrier_pending`: tenants
        whose barrier is queued or running now (their next pass request follows its completion, about now).
        Tenants with no history yet, or late (prediction passed by more than the slack), are left out.
        """
        skip = set(ready)
        pending = set(barrier_pending)
        out: dict[TenantId, Expected] = {}
        for tenant, track in self._tracks.items():
            if tenant in skip or now - track.last_arrival.get(lane, float("-inf")) > self._window:
                continue
            found = self._due(track, lane, now, tenant in pending)
            if found is None:
                continue
            due, gap = found
            latest = due + max(self._min_slack, self._slack * gap)
            if latest >= now:
                out[tenant] = Expected(due, latest)
        return out

    def _due(self, track: _Track, lane: str, now: float, barrier_pending: bool) -> tuple[float, float] | None:
        """(predicted arrival, the turnaround it is predicted from)."""
        if barrier_pending and lane == PASS:
            gap = self._gap(track, BARRIER, PASS)
            return None if gap is None else (now + gap, gap)
        if track.idle_since is None:
            return None  # something of it is queued or running in another lane; it is not waiting on its client
        after = track.idle_after
        if lane == PASS and after == PASS and self._usual_next(track, PASS) == BARRIER:
            # fb -> result -> optim_step -> result -> fb: two turnarounds away (the barrier itself is cheap).
            first, second = self._gap(track, PASS, BARRIER), self._gap(track, BARRIER, PASS)
            if first is None or second is None:
                return None
            return track.idle_since + first + second, first + second
        gap = self._gap(track, after, lane)
        return None if gap is None else (track.idle_since + gap, gap)

    def _gap(self, track: _Track, after: str, arrived: str) -> float | None:
        gaps = track.gaps.get((after, arrived)) or self._everyone.gaps.get((after, arrived))
        return statistics.median(gaps) if gaps else None

    def _usual_next(self, track: _Track, after: str) -> str | None:
        follows = track.follows.get(after) or self._everyone.follows.get(after)
        return max(set(follows), key=follows.count) if follows else None


class Expected(NamedTuple):
    due: float
    """Predicted arrival."""
    latest: float
    """Until when it is still waited for (the prediction plus a slack proportional to the turnaround)."""


@dataclass(frozen=True)
class HoldDecision:
    """`hold_s` None: dispatch now. Else wait up to `hold_s` for the `waiting_for` tenants."""

    hold_s: float | None
    waiting_for: frozenset[TenantId] = frozenset()


USUAL_WEIGHT = 0.2
"""Weight of the newest item in a lane's moving-average duration."""


class Holds:
    """The hold state of one scheduler: per lane (PASS, SAMPLE) its items' usual duration and when the item
    now held was first held; `decide` turns the forecast into a hold or a dispatch."""

    def __init__(self, factor: float, max_s: float, forecast: ArrivalForecast) -> None:
        self.forecast = forecast
        self._factor = factor
        self._max_s = max_s
        self._usual_s: dict[str, float] = {}
        self._held_since: dict[str, float] = {}

    def observe(self, lane: str, seconds: float) -> None:
        """An item of `lane` took `seconds`."""
        usual = self._usual_s.get(lane)
        self._usual_s[lane] = seconds if usual is None else usual + USUAL_WEIGHT * (seconds - usual)

    def release(self, lane: str) -> None:
        """`lane`'s item is dispatched (or there is none): the next hold starts afresh."""
        self._held_since.pop(lane, None)

    def decide(self, lane: str, now: float, ready: set[TenantId], barrier_pending: set[TenantId],
               fixed_cost_s: float | None, cap_s: float | None = None) -> float | None:
        """Seconds to hold `lane`'s next item, or None to dispatch it now. `fixed_cost_s`: a pass's fitted
        fixed cost, if there is a fit; `cap_s`: a tighter bound on the hold, if the caller has one."""
        usual = self._usual_s.get(lane)
        if usual is None or not self._factor > 0:
            return self.release(lane)
        expected = self.forecast.expected(lane, now, ready=ready, barrier_pending=barrier_pending)
        budget = min(self._max_s, self._factor * _fixed_cost(lane, usual, fixed_cost_s))
        if cap_s is not None:
            budget = min(budget, cap_s)
        decision = decide_hold(expected, now, self._held_since.setdefault(lane, now), budget)
        if decision.hold_s is None:
            self.release(lane)
        return decision.hold_s


def _fixed_cost(lane: str, usual: float, fitted: float | None) -> float:
    """What an item of `lane` costs whatever it holds: what a tenant joining it saves, and so what holding
    for it may cost. A pass's fitted fixed cost (half its usual duration until there is a fit); a sample
    batch's decode costs per step, nearly whatever its rows, so all of it."""
    if lane == SAMPLE:
        return usual
    return usual / 2 if fitted is None else fitted


def decide_hold(expected: Mapping[TenantId, Expected], now: float, held_since: float,
                budget_s: float) -> HoldDecision:
    """Hold while a tenant is predicted to arrive before the hold (begun at `held_since`) has lasted
    `budget_s`; wait until the last such tenant is due (plus its slack), re-deciding on every arrival."""
    deadline = held_since + budget_s
    due = {t: e for t, e in expected.items() if e.due <= deadline}
    if not due or now >= deadline:
        return HoldDecision(None)
    until = min(deadline, max(e.latest for e in due.values()))
    if until <= now:
        return HoldDecision(None)
    return HoldDecision(until - now, frozenset(due))
