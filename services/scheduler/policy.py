"""Packing and fairness policy: which ready requests go into the next pass and the next sample batch.

Pure decisions over values: no clock, no I/O, no knowledge of what a request computes. The state is
`FairPacker`'s per-tenant deficits, which is what makes fairness hold *across* passes. How big a contended
pass may be comes from `services/scheduler/pacing.py`.

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

import math
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from services.scheduler.ordering import UnorderedDedupe
from services.scheduler.pacing import DEFAULT_PASS_LATENCY_FACTOR
from services.scheduler.requests import ModelId, QueuedRequest, RequestId, TenantId


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
    hold_factor: float = 4.0
    """Hold a pass (or sample batch) for active tenants predicted to arrive (`services/scheduler/arrivals.py`)
    at most this many times the item's fixed cost (a pass's fitted fixed cost; a sample batch's duration):
    a tenant joining saves about one such cost (its own later item), and once tenants share items they come
    back together (a few passes' fixed costs saved per round). Where the fixed cost is small against the
    per-token cost (a big GPU pass), waiting would idle the engine for little, so holds are short. Never for
    a lone tenant. 0: off (dispatch what is queued)."""
    max_hold_seconds: float = 0.25
    """The longest a pass or sample batch is held for expected tenants, whatever its usual duration."""

    def __post_init__(self) -> None:
        if self.max_pass_seconds is not None and not self.max_pass_seconds > 0:
            raise ValueError(f"max_pass_seconds must be > 0, got {self.max_pass_seconds}")
        if not self.pass_latency_factor >= 0:
            raise ValueError(f"pass_latency_factor must be >= 0, got {self.pass_latency_factor}")
        if not self.hold_factor >= 0 or not self.max_hold_seconds >= 0:
            raise ValueError(f"hold_factor and max_hold_seconds must be >= 0, got {self.hold_factor}, "
                             f"{self.max_hold_seconds}")
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
                # The new round's turns start with whoever sent nothing in this pass yet: left to the
                # tenant order, one with credit left from earlier rounds could fill a small paced pass
                # before another's first turn, and a closed-loop light tenant would miss every other pass.
                sent = {r.tenant_id for r in chosen}
                order.sort(key=lambda t: t in sent)
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


class SampleQueues:
    """Queued sampling requests per tenant in arrival order, retries of one `(session, seq_id)` admitted once;
    batches are taken by `pick_sample_batch`. Tenants whose queue ran empty are not kept."""

    def __init__(self) -> None:
        self._dedupe = UnorderedDedupe()
        self._queues: dict[TenantId, deque[QueuedRequest]] = {}

    def admit(self, request: QueuedRequest) -> tuple[RequestId, bool]:
        """(request_id, is_new): a retry maps onto the request already admitted and is not queued again."""
        request_id, is_new = self._dedupe.admit(request)
        if is_new:
            self._queues.setdefault(request.tenant_id, deque()).append(request)
        return request_id, is_new

    def tenants(self) -> set[TenantId]:
        return set(self._queues)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)  # emptied queues are dropped

    def __iter__(self) -> Iterator[QueuedRequest]:
        for queue in self._queues.values():
            yield from queue

    def take(self, max_batch: int) -> list[QueuedRequest]:
        """Pop the next batch (round robin over tenants, the one waiting longest first)."""
        chosen = pick_sample_batch(self._queues, max_batch)
        for request in chosen:
            queue = self._queues[request.tenant_id]
            popped = queue.popleft()
            assert popped is request, "the picker takes each tenant's samples in queue order"
            if not queue:
                del self._queues[request.tenant_id]
        return chosen
