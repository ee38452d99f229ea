"""Packing and fairness policy: which ready requests go into the next pass and the next sample batch.

Pure decisions over values: no clock, no I/O, no knowledge of what a request computes. The only state is
`FairPacker`'s per-tenant deficits, which is what makes fairness hold *across* passes.

Fairness is weighted deficit round robin by tokens (Shreedhar & Varghese): every backlogged tenant earns
`quantum_tokens * weight` per round and spends it on the tokens of the requests it sends, so over time
tenants share passes in proportion to their weights whatever their request sizes; a tenant sending ten
times the tokens gets no more than its share, and a small request waits at most a few rounds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.scheduler.requests import ModelId, QueuedRequest, TenantId


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

    def __post_init__(self) -> None:
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
    """What is left of the pass being built."""

    tokens_left: int
    adapters_left: int
    models: set[ModelId] = field(default_factory=set)

    def fits(self, request: QueuedRequest) -> bool:
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


class FairPacker:
    """Builds passes by weighted deficit round robin over tenants; keeps deficits between passes."""

    def __init__(self, quantum_tokens: int, weights: Mapping[TenantId, float] | None = None) -> None:
        self._quantum = quantum_tokens
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

    def pack(self, runs: Sequence[Sequence[QueuedRequest]], limits: SchedulerLimits) -> list[QueuedRequest]:
        """Choose the next pass from `runs` (each: one model's consecutive pass-kind requests in seq order).

        Returns the chosen requests; from every run they form a prefix, so the caller can pop them.
        """
        lanes = self._lanes(runs)
        self._forget_idle(lanes)
        room = _PassRoom(limits.max_tokens_per_pass, limits.max_adapters_per_pass)
        order = sorted(lanes, key=lambda t: (self._last_served.get(t, -1), t))
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

    def _top_up(self, order: list[TenantId], lanes: dict[TenantId, _Lane], room: _PassRoom) -> None:
        """Grant the fewest whole rounds of quantum after which some tenant can send its head.

        Equivalent to running that many DRR rounds in which nobody could send, in one go.
        """
        rounds = math.inf
        for tenant in order:
            found = lanes[tenant].head(room)
            assert found is not None
            need = found[1].num_tokens - self._deficits[tenant]
            rounds = min(rounds, math.ceil(need / (self._quantum * self.weight(tenant))))
        grant = max(1, int(rounds))
        for tenant in order:
            self._deficits[tenant] += grant * self._quantum * self.weight(tenant)

    def _lanes(self, runs: Sequence[Sequence[QueuedRequest]]) -> dict[TenantId, _Lane]:
        lanes: dict[TenantId, _Lane] = {}
        for run in runs:
            if run:
                lanes.setdefault(run[0].tenant_id, _Lane()).add_run(run)
        return lanes

    def _forget_idle(self, lanes: Mapping[TenantId, _Lane]) -> None:
        """Classic DRR: a tenant with nothing queued loses its unused credit, so it cannot hoard it."""
        self._deficits = {t: self._deficits.get(t, 0.0) for t in lanes}


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
