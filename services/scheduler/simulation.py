"""A discrete-event simulation of one base model's service: the real `Scheduler` on a simulated clock,
a simulated engine whose items cost fixed + per-token time, and closed-loop clients.

It exists so that scheduling decisions can be judged without a GPU, a server or wall-clock timing: the
unit tests (`tests/unit/test_scheduler_hold.py`) and `bench/gpu_sim.py` drive it. It mirrors what
`services/runtime/loop.py` does: step, run the plan's items one after another (the clock advances by each
item's cost), complete them, and when the step held an item, wait for the next arrival or the hold's end.

Clients behave like the `tinker` SDK in a training loop: `forward_backward` -> result -> `optim_step` ->
result -> (think) -> next, or for sampling `sample` -> result -> (think) -> next. A client's next request
arrives `turnaround_s` (times a seeded jitter) after its result was published: the long-poll wake-up, HTTP
and SDK time that independent clients never share.
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from dataclasses import dataclass, field

from services.scheduler.policy import SchedulerLimits
from services.scheduler.requests import (
    BarrierPlan,
    ModelId,
    PassPlan,
    PlanItem,
    QueuedRequest,
    RequestId,
    RequestKind,
    TenantId,
)
from services.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class EngineCost:
    """Seconds an item takes: a pass `fixed_s + per_token_s * tokens`, a sample batch `sample_fixed_s +
    sample_per_request_s * requests`, a barrier `barrier_s`."""

    fixed_s: float
    per_token_s: float
    barrier_s: float = 0.0005
    sample_fixed_s: float = 0.05
    sample_per_request_s: float = 0.005

    def of(self, item: PlanItem) -> float:
        if isinstance(item, PassPlan):
            return self.fixed_s + self.per_token_s * item.num_tokens
        if isinstance(item, BarrierPlan):
            return self.barrier_s
        return self.sample_fixed_s + self.sample_per_request_s * len(item.requests)


@dataclass(frozen=True)
class Client:
    """One tenant's closed loop: `tokens` per forward_backward (or per sample request when `sampling`)."""

    tenant: str
    tokens: int
    turnaround_s: float
    think_s: float = 0.0
    """Client work before each forward_backward / sample (data preparation, a rollout elsewhere)."""
    sampling: bool = False
    start_s: float = 0.0
    models: int = 1
    """Independent loops of this tenant (each its own model), like bench/fairness.py's heavy tenant."""
    pipelined: bool = False
    """Submit each `optim_step` together with its `forward_backward` (as the SDK's futures allow and
    bench/fairness.py does) instead of after the forward_backward's result."""

    def loops(self) -> list[str]:
        return [self.tenant] if self.models == 1 else [f"{self.tenant}/{k}" for k in range(self.models)]


@dataclass
class SimReport:
    seconds: float = 0.0
    pass_tenants: list[int] = field(default_factory=list)
    pass_tokens: list[int] = field(default_factory=list)
    sample_batch_sizes: list[int] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    """Trained (or, for sampling clients, requested) tokens per tenant."""
    latencies: dict[str, list[float]] = field(default_factory=dict)
    """Per tenant: forward_backward (or sample) submit-to-completion times."""
    pass_active: list[int] = field(default_factory=list)
    """Per pass: tenants active when it was dispatched (not thinking: waiting on the service, or on their
    way to it); the ideal pass holds all of them."""
    holds: int = 0
    engine_busy_s: float = 0.0

    @property
    def packing_vs_active(self) -> float:
        """Mean over passes of its tenants over the tenants active then (1: every active tenant in every pass)."""
        pairs = [(n, a) for n, a in zip(self.pass_tenants, self.pass_active, strict=True) if a]
        return statistics.mean(n / a for n, a in pairs) if pairs else 0.0

    @property
    def mean_tenants_per_pass(self) -> float:
        return statistics.mean(self.pass_tenants) if self.pass_tenants else 0.0

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens.values()) / self.seconds if self.seconds else 0.0


class ClosedLoopSim:
    """Runs `clients` against a `Scheduler(limits)` on the simulated clock with `cost` as the engine;
    `jitter` spreads each turnaround uniformly by ± that fraction (seeded)."""

    def __init__(self, limits: SchedulerLimits, cost: EngineCost, clients: list[Client], *, jitter: float = 0.2,
                 seed: int = 0) -> None:
        self.scheduler = Scheduler(limits, clock=self.clock)
        self.cost = cost
        self.clients = {c.tenant: c for c in clients}
        self._loops = {loop: c for c in clients for loop in c.loops()}
        self.now = 0.0
        self._rng = random.Random(seed)
        self._jitter = jitter
        self._events: list[tuple[float, int, str, RequestKind]] = []
        self._order = itertools.count()
        self._seq: dict[str, int] = {}
        self._submitted: dict[RequestId, tuple[float, str]] = {}
        self._stopped: set[str] = set()
        self._thinking: dict[str, tuple[float, float]] = {}
        self.report = SimReport()
        for loop, client in self._loops.items():
            if not client.sampling:
                self.scheduler.open_model(ModelId(loop), next_seq_id=1)
            self._at(client.start_s, loop, _first_kind(client))

    def clock(self) -> float:
        """The scheduler's clock: simulated seconds."""
        return self.now

    def stop(self, tenant: str) -> None:
        """`tenant` sends nothing after its requests in the queue or in flight."""
        self._stopped.add(tenant)

    def run(self, seconds: float) -> SimReport:
        end = self.now + seconds
        started, holds_before = self.now, self.scheduler.stats().holds
        while self.now < end:
            self._arrive()
            plan = self.scheduler.step()
            for item in plan.items:
                self._execute(item)
            if plan.items:
                continue
            next_event = self._events[0][0] if self._events else end
            wake = next_event if plan.hold_s is None else min(self.now + plan.hold_s, next_event)
            self.now = max(self.now, min(wake, end))
            if self.now >= end:
                break
        self.report.seconds += self.now - started
        self.report.holds += self.scheduler.stats().holds - holds_before
        return self.report

    def _at(self, when: float, loop: str, kind: RequestKind) -> None:
        heapq.heappush(self._events, (when, next(self._order), loop, kind))

    def _arrive(self) -> None:
        """Submit what arrived by now; the loop learns of it only now (after the item that ran), but the
        request carries its arrival time, as `enqueued_at` does in the service."""
        while self._events and self._events[0][0] <= self.now:
            at, _, loop, kind = heapq.heappop(self._events)
            self._submit(loop, kind, at)

    def _submit(self, loop: str, kind: RequestKind, at: float) -> None:
        self._submit_one(loop, kind, at)
        if kind is RequestKind.FORWARD_BACKWARD and self._loops[loop].pipelined:
            self._submit_one(loop, RequestKind.OPTIM_STEP, at)

    def _submit_one(self, loop: str, kind: RequestKind, at: float) -> None:
        client = self._loops[loop]
        seq = self._seq.get(loop, 0) + 1
        self._seq[loop] = seq
        request_id = RequestId(f"{loop}#{seq}")
        tokens = 0 if kind is RequestKind.OPTIM_STEP else client.tokens
        model = ModelId(loop if kind.is_ordered else f"{loop}:sampler")
        self._submitted[request_id] = (at, loop)
        self.scheduler.submit(QueuedRequest(request_id, TenantId(client.tenant), model, kind,
                                            seq if kind.is_ordered else None, tokens, at))

    def _execute(self, item: PlanItem) -> None:
        seconds = self.cost.of(item)
        if isinstance(item, PassPlan):
            self.report.pass_active.append(sum(1 for t in self.clients if t not in self._stopped
                                               and not self._is_thinking(t)))
        self.now += seconds
        self.report.engine_busy_s += seconds
        if isinstance(item, PassPlan):
            self.report.pass_tenants.append(len(item.tenants))
            self.report.pass_tokens.append(item.num_tokens)
        elif not isinstance(item, BarrierPlan):
            self.report.sample_batch_sizes.append(len(item.requests))
        for completion in self.scheduler.complete(item, [object()] * len(item.requests)):
            self._completed(completion.request)

    def _completed(self, request: QueuedRequest) -> None:
        submitted, loop = self._submitted.pop(request.request_id)
        client = self._loops[loop]
        if request.kind is not RequestKind.OPTIM_STEP:
            self.report.tokens[client.tenant] = self.report.tokens.get(client.tenant, 0) + request.num_tokens
            self.report.latencies.setdefault(client.tenant, []).append(self.now - submitted)
        if client.tenant in self._stopped:
            return
        turnaround = client.turnaround_s * self._rng.uniform(1 - self._jitter, 1 + self._jitter)
        if request.kind is RequestKind.FORWARD_BACKWARD:
            if not client.pipelined:
                self._at(self.now + turnaround, loop, RequestKind.OPTIM_STEP)
        else:
            self._thinking[loop] = (self.now, self.now + client.think_s)
            self._at(self.now + client.think_s + turnaround, loop, _first_kind(client))

    def _is_thinking(self, tenant: str) -> bool:
        """Whether every loop of `tenant` is in its think time now."""
        spans = [self._thinking.get(loop, (0.0, 0.0)) for loop in self.clients[tenant].loops()]
        return all(start <= self.now < end for start, end in spans)


def wait_ratio_beside(limits: SchedulerLimits, cost: EngineCost, client: Client, others: list[Client], *,
                      seconds: float, alone_seconds: float, seed: int = 0) -> tuple[float, SimReport]:
    """`client`'s median wait beside `others` over its median wait alone (each run on its own simulation),
    and the report of the shared run: how bench/fairness.py judges a light tenant beside a heavy one."""
    alone = ClosedLoopSim(limits, cost, [client], seed=seed).run(alone_seconds)
    shared = ClosedLoopSim(limits, cost, [client, *others], seed=seed).run(seconds)
    ratio = statistics.median(shared.latencies[client.tenant]) / statistics.median(alone.latencies[client.tenant])
    return ratio, shared


def _first_kind(client: Client) -> RequestKind:
    return RequestKind.SAMPLE if client.sampling else RequestKind.FORWARD_BACKWARD
