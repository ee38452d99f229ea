"""The scheduler's per-tenant backlog bookkeeping (`services/scheduler/backlog.py`): completing an item costs
O(its requests), not O(everything queued), and still tells the arrival forecast exactly which tenants have
nothing left (queued, early or in flight)."""

from __future__ import annotations

from collections import Counter

import pytest

from services.scheduler import (
    BarrierPlan,
    ModelId,
    PassPlan,
    QueuedRequest,
    RequestId,
    RequestKind,
    Scheduler,
    SchedulerLimits,
    TenantId,
)
from services.scheduler.arrivals import ArrivalForecast

FB, OPTIM, SAMPLE = RequestKind.FORWARD_BACKWARD, RequestKind.OPTIM_STEP, RequestKind.SAMPLE
READS: Counter[str] = Counter()


class CountedRequest(QueuedRequest):
    """A request that counts how often the scheduler reads its tenant (what a scan over it would do)."""

    def __getattribute__(self, name: str) -> object:
        if name == "tenant_id":
            READS[name] += 1
        return object.__getattribute__(self, name)


def request(tenant: str, model: str, seq: int | None, kind: RequestKind = FB, tokens: int = 8) -> QueuedRequest:
    return CountedRequest(RequestId(f"{model}#{kind.value}#{seq}"), TenantId(tenant), ModelId(model), kind, seq,
                          0 if kind is OPTIM else tokens)


def scheduler() -> Scheduler:
    # No holds: every step dispatches what is queued, so the test decides what is pending.
    return Scheduler(SchedulerLimits(hold_factor=0.0), clock=lambda: 100.0)


def test_completing_an_item_does_not_scan_the_queued_work() -> None:
    s = scheduler()
    for i in range(300):
        s.open_model(ModelId(f"m{i}"), next_seq_id=1)
        s.submit(request(f"t{i}", f"m{i}", 1))
    s.open_model(ModelId("opt"), next_seq_id=1)
    s.submit(request("busy", "opt", 1, OPTIM))
    plan = s.step()
    barrier = next(item for item in plan.items if isinstance(item, BarrierPlan))
    pass_ = next(item for item in plan.items if isinstance(item, PassPlan))
    assert len(pass_.requests) < 300  # most of the pass work is still queued
    for item in (barrier, pass_):
        READS.clear()
        s.complete(item, [object()] * len(item.requests))
        # A few reads per completed request, whatever is queued (a scan read all ~240 queued ones).
        assert READS["tenant_id"] <= 4 * len(item.requests)


@pytest.fixture
def idle_flags(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """(tenant, idle) as the scheduler reports completions to the arrival forecast."""
    flags: list[tuple[str, bool]] = []
    original = ArrivalForecast.completed

    def spy(self: ArrivalForecast, tenant: TenantId, kind: RequestKind, now: float, *, idle: bool) -> None:
        flags.append((tenant, idle))
        original(self, tenant, kind, now, idle=idle)

    monkeypatch.setattr(ArrivalForecast, "completed", spy)
    return flags


def test_a_tenant_is_idle_only_once_nothing_of_it_is_left(idle_flags: list[tuple[str, bool]]) -> None:
    s = scheduler()
    for model in ("a-1", "a-2", "b-1", "c-1"):
        s.open_model(ModelId(model), next_seq_id=1)
    s.submit(request("a", "a-1", 1))
    s.submit(request("a", "a-2", 2))  # early: seq 1 of a-2 has not arrived
    s.submit(request("b", "b-1", 1))
    s.submit(request("c", "c-1", 1))
    s.submit(request("c", "c-sampler", None, SAMPLE))
    plan = s.step()
    (pass_,) = plan.passes
    (samples,) = plan.sample_batches
    s.complete(pass_, [object()] * len(pass_.requests))
    assert sorted(idle_flags) == [("a", False), ("b", True), ("c", False)]  # a: early work; c: a sample in flight
    idle_flags.clear()
    s.complete(samples, [object()])
    assert idle_flags == [("c", True)]
    idle_flags.clear()
    s.close_model(ModelId("a-2"))  # drops a's early request
    s.submit(request("a", "a-1", 2))
    (again,) = s.step().passes
    s.complete(again, [object()])
    assert idle_flags == [("a", True)]
