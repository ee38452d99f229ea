"""Packing and fairness policy: which ready requests go into the next pass and the next sample batch.

Pure decisions over values: no clock, no I/O, no knowledge of what a request computes. The state is
`FairPacker`'s per-tenant deficits, which is what makes fairness hold *across* passes, and `PassCostModel`'s
fit of how long passes take (durations are handed in by the scheduler).

Fairness is weighted deficit round robin by tokens (Shreedhar & Varghese): every backlogged tenant earns
`quantum_tokens * weight` per round and spends it on the tokens of the requests it sends, so over time
tenants share passes in proportion to their weights whatever their request sizes; a tenant sending ten
times the tokens gets no more than its share, and a small request waits at most a few rounds. The quantum
of a pass is at most its token budget: a tenant's leftover credit then covers at most about one pass, so a
newly backlogged tenant (credit 0) is not held back for many small paced passes; and a tenant that missed
the last pass gets its turn's quantum before others spend leftover credit, so it is not held back even
from passes that fit one request.

Latency: a running pass cannot be pre-empted, so a request that arrives mid-pass waits for it. While two or
more tenants contend, `PassPacer` sizes passes from `PassCostModel` (a pass costs fixed + per-token time,
fitted from observed passes) so that a pass takes about `pass_latency_factor` times what the smallest
contending tenant's queued work takes alone; that bounds a light tenant's wait beside a heavy one in terms
of its own latency. Where the fixed cost dominates (a GPU) passes stay large (thousands of tokens); where a pass
costs time in proportion to its tokens (a CPU) passes shrink. `max_pass_seconds` overrides the target.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.scheduler.requests import ModelId, QueuedRequest, TenantId

DEFAULT_PASS_LATENCY_FACTOR = 1.5
"""A latency multiple, not a machine constant. A light request that arrives just after a pass started waits it
out and rides in the next, so its worst-case wait is about 2x this factor times its own pass; one arriving at
a random point waits about 1.5x. Chosen with bench/fairness.py (docs/performance.md, "Fairness"): 1.5 kept
the light tenant's median wait at 1.3-1.6x its wait alone; 4/3 at 1.2-1.3x, but with 21-25 % less
throughput for the heavy tenant."""


@dataclass(frozen=True)
class SchedulerLimits:
    """Budgets of one scheduler (one base model). Settings map onto these fields."""

    max_tokens_per_pass: int = 16384
    """Tokens in one packed pass; a pass-kind request larger than this fails with a user error."""
    max_adapters_per_pass: int = 64
    """Distinct models (adapters) in one pass."""
    max_passes_per_step: int = 1
    """Passes planned per step; 1 lets requests that arrive during a pass join the next one."""
    quantum_tokens: int = 2048
    """Tokens a weight-1 tenant earns per fairness round; smaller = finer interleaving, more rounds."""
    max_sample_batch: int = 64
    """Sampling requests in one batched generate call."""
    max_sample_batches_per_step: int = 1
    max_pass_seconds: float | None = None
    """Explicit pass-duration target while several tenants contend (overrides `pass_latency_factor`): the
    pass's token budget shrinks to what the fitted pass cost runs in this time (never below one request).
    None: the target follows `pass_latency_factor`."""
    pass_latency_factor: float = DEFAULT_PASS_LATENCY_FACTOR
    """While several tenants contend, keep a pass about this many times as long as the smallest contending
    tenant's queued pass work takes alone (by the fitted pass cost), so a light tenant's wait stays within a
    small multiple of its own latency. Above 1, the fixed part of a pass's cost lets others ride along: where
    it dominates (a GPU) passes stay large. 0: off (passes fill `max_tokens_per_pass`, most packing)."""

    def __post_init__(self) -> None:
        if self.max_pass_seconds is not None and not self.max_pass_seconds > 0:
            raise ValueError(f"max_pass_seconds must be > 0, got {self.max_pass_seconds}")
        if not self.pass_latency_factor >= 0:
            raise ValueError(f"pass_latency_factor must be >= 0, got {self.pass_latency_factor}")
        for name in (
            "max_tokens_per_pass",
            "max_adapters_per_pass",
            "max_passes_per_step",
            "quantum_tokens",
            "max_sample_batch",
            "max_sample_batches_per_step",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class PassCostModel:
    """A pass's duration as `fixed + per_token * tokens`, fitted to the last `window` passes.

    Robust rather than least squares, because a shared machine now and then stalls a pass for many times its
    usual time: the per-token cost is the median of the slopes between pairs of recent passes whose sizes
    differ by at least `min_spread` (Theil-Sen, each pair weighted by how far apart its sizes are), the fixed
    cost the median of what each pass took beyond its tokens. The first pass is not used (it pays for
    warm-up). Fixed and per-token cost can only be told apart from passes of different sizes: until
    `min_pairs` such pairs were seen there is no fit, and while recent passes are all alike the last slope is
    kept (the fixed cost still follows, so a machine that gets slower still shows).
    """

    def __init__(self, window: int = 24, min_spread: float = 0.25, min_pairs: int = 8) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self._passes: deque[tuple[int, float]] = deque(maxlen=window)
        self._min_spread = min_spread
        self._min_pairs = min_pairs
        self._warm = False
        self._slope: float | None = None
        self._cost: tuple[float, float] | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        """A pass of `tokens` took `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        if not self._warm:
            self._warm = True
            return
        self._passes.append((tokens, seconds))
        slope = self._pairwise_slope()
        if slope is not None:
            self._slope = slope
        if self._slope is not None:
            # A line through the origin at the most: a negative fixed cost is noise in the slope.
            self._cost = max(0.0, statistics.median(t - self._slope * n for n, t in self._passes)), self._slope

    def _pairwise_slope(self) -> float | None:
        pairs = [((t2 - t1) / (n2 - n1), abs(n2 - n1))
                 for (n1, t1), (n2, t2) in itertools.combinations(self._passes, 2)
                 if abs(n2 - n1) >= self._min_spread * max(n1, n2)]
        if len(pairs) < self._min_pairs:
            return None
        # Noise can make the slope negative; time does not fall with tokens, so clamp it.
        return max(0.0, _weighted_median(pairs))

    def cost(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token); None until passes of different sizes were seen."""
        return self._cost

    def estimate(self, tokens: int) -> float | None:
        """Seconds a pass of `tokens` should take; None without a fit."""
        cost = self._cost
        return None if cost is None else cost[0] + cost[1] * tokens

    def typical_tokens(self) -> int | None:
        """The median size of recent passes; None before any."""
        return int(statistics.median(n for n, _ in self._passes)) if self._passes else None


def _weighted_median(values: Sequence[tuple[float, float]]) -> float:
    """The median of (value, weight) pairs: pairs of passes far apart in size tell the slope best."""
    ordered = sorted(values)
    half, running = sum(w for _, w in ordered) / 2, 0.0
    for value, weight in ordered:
        running += weight
        if running >= half:
            return value
    return ordered[-1][0]


class PassPacer:
    """Turns contention into a per-pass token budget: the most tokens whose estimated pass fits the target.

    The target is `max_pass_seconds` when set, else `latency_factor` times the estimated alone-time of the
    smallest contending tenant's work. With cost `fixed + per_token * n` and factor f, a tenant whose work
    is `n_min` tokens gets passes of `f * n_min + (f - 1) * fixed / per_token` tokens: on a GPU (fixed cost
    dominant) thousands of tokens, in practice all that is queued; on a CPU (per-token dominant) a few
    times `n_min`. Without a fit passes stay full, except that every `probe_every`-th contended pass starts
    a probe (passes of half the usual size until one has run), so that the model sees the sizes it needs.
    """

    def __init__(self, max_pass_seconds: float | None, latency_factor: float,
                 model: PassCostModel | None = None, probe_every: int = 8) -> None:
        self._max_pass_s = max_pass_seconds
        self._factor = latency_factor
        self.model = model or PassCostModel()
        self._probe_every = probe_every
        self._unfitted_budgets = 0
        self._probe: int | None = None
        """The token budget of a probe under way."""

    @property
    def enabled(self) -> bool:
        return self._max_pass_s is not None or self._factor > 0

    def observe(self, tokens: int, seconds: float) -> None:
        """A pass of `tokens` took `seconds` (from dispatch to completion)."""
        self.model.observe(tokens, seconds)
        if self._probe is not None and 0 < tokens <= self._probe:
            self._probe = None

    def target_s(self, smallest_work: int) -> float | None:
        """How long a pass should take beside a tenant whose queued work is `smallest_work` tokens."""
        if self._max_pass_s is not None:
            return self._max_pass_s
        alone_s = self.model.estimate(smallest_work)
        return None if alone_s is None or not self._factor > 0 else self._factor * alone_s

    def budget(self, hard_limit: int, smallest_work: int) -> int:
        """Tokens the next contended pass may hold (unpaced: the hard limit). A first request larger than
        the budget still runs, alone."""
        if not self.enabled:
            return hard_limit
        cost, target = self.model.cost(), self.target_s(min(smallest_work, hard_limit))
        if cost is None or target is None:
            return self._unfitted_budget(hard_limit)
        fixed, per_token = cost
        if per_token <= 0:
            return hard_limit if target >= fixed else 1
        # The epsilon keeps f = 1 from rounding n_min down to n_min - 1.
        return max(1, min(hard_limit, math.floor((target - fixed) / per_token + 1e-6)))

    def _unfitted_budget(self, hard_limit: int) -> int:
        """Full passes, and every so often a probe: half the usual size until a pass that small has run (a
        probe planned when only a big request is queued runs at full size, and would teach nothing), for at
        most `probe_every` passes (requests may all be too big to make one)."""
        self._unfitted_budgets += 1
        if not self._unfitted_budgets % self._probe_every:
            typical = self.model.typical_tokens()
            self._probe = None if self._probe is not None or typical is None else max(1, typical // 2)
        return hard_limit if self._probe is None else min(hard_limit, self._probe)


@dataclass
class _PassRoom:
    """What is left of the pass being built. An empty pass takes any one request up to `hard_limit`."""

    tokens_left: int
    adapters_left: int
    hard_limit: int
    models: set[ModelId] = field(default_factory=set)

    def fits(self, request: QueuedRequest) -> bool:
        if not self.models:
            return request.num_tokens <= self.hard_limit and self.adapters_left > 0
        if request.num_tokens > self.tokens_left:
            return False
        return request.model_id in self.models or self.adapters_left > 0

    def add(self, request: QueuedRequest) -> None:
        self.tokens_left -= request.num_tokens
        if request.model_id not in self.models:
            self.models.add(request.model_id)
            self.adapters_left -= 1


class _Lane:
    """One tenant's candidates: the runs of its models, each consumed from the front (seq order)."""

    def __init__(self) -> None:
        self._runs: list[Sequence[QueuedRequest]] = []
        self._taken: list[int] = []

    def add_run(self, run: Sequence[QueuedRequest]) -> None:
        if run:
            self._runs.append(run)
            self._taken.append(0)

    def head(self, room: _PassRoom) -> tuple[int, QueuedRequest] | None:
        """The oldest run head that fits the pass, with its run index; None if nothing fits."""
        best: tuple[int, QueuedRequest] | None = None
        for i, run in enumerate(self._runs):
            if self._taken[i] >= len(run):
                continue
            candidate = run[self._taken[i]]
            if room.fits(candidate) and (best is None or candidate.enqueued_at < best[1].enqueued_at):
                best = (i, candidate)
        return best

    def take(self, run_index: int) -> None:
        self._taken[run_index] += 1

    def largest_head(self) -> int:
        """Tokens of the largest request at the front of a run (what credit may need to be saved for)."""
        return max((run[i].num_tokens for run, i in zip(self._runs, self._taken, strict=True) if i < len(run)),
                   default=0)


class FairPacker:
    """Builds passes by weighted deficit round robin over tenants; keeps deficits between passes."""

    def __init__(self, quantum_tokens: int, weights: Mapping[TenantId, float] | None = None) -> None:
        self._quantum = quantum_tokens
        self._round_quantum = quantum_tokens
        """The quantum of the pass being built: no larger than its token budget, so that when passes are
        paced small a tenant's credit runs out within a few passes and the others' turn comes."""
        self._weights: dict[TenantId, float] = {}
        for tenant, weight in (weights or {}).items():
            self.set_weight(tenant, weight)
        self._deficits: dict[TenantId, float] = {}
        self._last_served: dict[TenantId, int] = {}
        self._passes = 0

    def set_weight(self, tenant_id: TenantId, weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"tenant weight must be > 0, got {weight}")
        self._weights[tenant_id] = weight

    def weight(self, tenant_id: TenantId) -> float:
        return self._weights.get(tenant_id, 1.0)

    def deficit(self, tenant_id: TenantId) -> float:
        return self._deficits.get(tenant_id, 0.0)

    def pack(self, runs: Sequence[Sequence[QueuedRequest]], limits: SchedulerLimits,
             token_budget: int | None = None) -> list[QueuedRequest]:
        """Choose the next pass from `runs` (each: one model's consecutive pass-kind requests in seq order).

        `token_budget` (default: `limits.max_tokens_per_pass`) may be smaller than the hard limit; a first
        request larger than it still goes alone. Returns the chosen requests; from every run they form a
        prefix, so the caller can pop them.
        """
        hard = limits.max_tokens_per_pass
        budget = hard if token_budget is None else min(token_budget, hard)
        self._round_quantum = min(self._quantum, budget)
        lanes = self._lanes(runs)
        self._forget_idle(lanes)
        room = _PassRoom(budget, limits.max_adapters_per_pass, hard)
        order = sorted(lanes, key=lambda t: (self._last_served.get(t, -1), t))
        if order and self._last_served.get(order[0], -1) < self._passes:
            self._grant_first_turn(order[0], lanes[order[0]], room)
        chosen: list[QueuedRequest] = []
        while order:
            order = [t for t in order if lanes[t].head(room) is not None]
            served = self._sweep(order, lanes, room, chosen)
            if order and not served:
                self._top_up(order, lanes, room)
        if chosen:
            self._passes += 1
        for request in chosen:
            self._last_served[request.tenant_id] = self._passes
        return chosen

    def _sweep(
        self,
        order: list[TenantId],
        lanes: dict[TenantId, _Lane],
        room: _PassRoom,
        chosen: list[QueuedRequest],
    ) -> bool:
        """One round: each tenant sends its head if its deficit covers it. Returns whether any did."""
        served = False
        for tenant in order:
            found = lanes[tenant].head(room)
            if found is None or found[1].num_tokens > self._deficits[tenant]:
                continue
            run_index, request = found
            lanes[tenant].take(run_index)
            room.add(request)
            self._deficits[tenant] -= request.num_tokens
            chosen.append(request)
            served = True
        return served

    def _grant_first_turn(self, tenant: TenantId, lane: _Lane, room: _PassRoom) -> None:
        """DRR grants a tenant its quantum when its turn comes, and the turn of the least recently served
        tenant (called only when it missed the last pass) is first: if one quantum lets it send its head, it
        gets that quantum now. Otherwise a tenant that just became backlogged (no credit) would let others
        spend credit left from earlier passes first, and miss every pass too small for both (paced passes of
        about one request)."""
        found = lane.head(room)
        if found is None:
            return
        need = found[1].num_tokens - self._deficits[tenant]
        quantum = self._round_quantum * self.weight(tenant)
        if 0 < need <= quantum:
            self._deficits[tenant] += quantum

    def _top_up(self, order: list[TenantId], lanes: dict[TenantId, _Lane], room: _PassRoom) -> None:
        """Grant the fewest whole rounds of quantum after which some tenant can send its head.

        Equivalent to running that many DRR rounds in which nobody could send, in one go.
        """
        rounds = math.inf
        for tenant in order:
            found = lanes[tenant].head(room)
            assert found is not None
            need = found[1].num_tokens - self._deficits[tenant]
            rounds = min(rounds, math.ceil(need / (self._round_quantum * self.weight(tenant))))
        grant = max(1, int(rounds))
        for tenant in order:
            self._deficits[tenant] += grant * self._round_quantum * self.weight(tenant)

    def _lanes(self, runs: Sequence[Sequence[QueuedRequest]]) -> dict[TenantId, _Lane]:
        lanes: dict[TenantId, _Lane] = {}
        for run in runs:
            if run:
                lanes.setdefault(run[0].tenant_id, _Lane()).add_run(run)
        return lanes

    def _forget_idle(self, lanes: Mapping[TenantId, _Lane]) -> None:
        """Classic DRR: a tenant with nothing queued loses its unused credit, so it cannot hoard it. (Granting a
        returning tenant a quantum instead would let a tenant that goes idle between requests jump the queue
        forever: a tenant whose big request needs saved-up credit would never get it.)"""
        self._deficits = {t: min(self._deficits.get(t, 0.0), self._credit_cap(t, lane)) for t, lane in lanes.items()}

    def _credit_cap(self, tenant_id: TenantId, lane: _Lane) -> float:
        """Credit kept from pass to pass: a round's quantum, or what the tenant saves up for its biggest head.
        Credit left over from large passes would otherwise keep others out of many small paced ones."""
        return max(self._round_quantum * self.weight(tenant_id), float(lane.largest_head()))


def pick_sample_batch(
    queues: Mapping[TenantId, Sequence[QueuedRequest]], max_batch: int
) -> list[QueuedRequest]:
    """Round robin over tenants (the one waiting longest first), one request per tenant per round.

    Sampling requests are independent, so fairness per request is enough; the result is a prefix of
    every tenant's queue, in pick order.
    """
    tenants = sorted((t for t in queues if queues[t]), key=lambda t: (queues[t][0].enqueued_at, t))
    taken = dict.fromkeys(tenants, 0)
    chosen: list[QueuedRequest] = []
    while tenants and len(chosen) < max_batch:
        for tenant in list(tenants):
            if len(chosen) >= max_batch:
                break
            chosen.append(queues[tenant][taken[tenant]])
            taken[tenant] += 1
            if taken[tenant] >= len(queues[tenant]):
                tenants.remove(tenant)
    return chosen
