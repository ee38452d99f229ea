"""Packing policy: budgets, adapter limit, run prefixes, weighted DRR fairness, sample round robin."""

from __future__ import annotations

import pytest

from services.scheduler.policy import FairPacker, SchedulerLimits, pick_sample_batch
from services.scheduler.requests import ModelId, QueuedRequest, RequestId, RequestKind, TenantId


def run(tenant: str, model: str, sizes: list[int], *, t0: float = 0.0) -> list[QueuedRequest]:
    """One model's consecutive forward_backward requests (seq 1..n)."""
    return [
        QueuedRequest(
            request_id=RequestId(f"{model}/{i}"),
            tenant_id=TenantId(tenant),
            model_id=ModelId(model),
            kind=RequestKind.FORWARD_BACKWARD,
            seq_id=i,
            num_tokens=size,
            enqueued_at=t0 + i,
        )
        for i, size in enumerate(sizes, start=1)
    ]


def tokens_by_tenant(chosen: list[QueuedRequest]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for r in chosen:
        totals[r.tenant_id] = totals.get(r.tenant_id, 0) + r.num_tokens
    return totals


def is_prefix_of_runs(chosen: list[QueuedRequest], runs: list[list[QueuedRequest]]) -> bool:
    for r in runs:
        picked = [x for x in chosen if x.model_id == r[0].model_id]
        if picked != r[: len(picked)]:
            return False
    return True


def test_limits_validate() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_pass"):
        SchedulerLimits(max_tokens_per_pass=0)
    with pytest.raises(ValueError, match="weight"):
        FairPacker(16, {TenantId("a"): 0.0})


def test_pack_respects_the_token_budget_and_takes_run_prefixes() -> None:
    runs = [run("a", "ma", [300, 300, 300]), run("b", "mb", [250, 250]), run("c", "mc", [100])]
    chosen = FairPacker(quantum_tokens=100).pack(runs, SchedulerLimits(max_tokens_per_pass=1000))
    assert sum(r.num_tokens for r in chosen) <= 1000
    assert {r.tenant_id for r in chosen} == {"a", "b", "c"}
    assert is_prefix_of_runs(chosen, runs)


def test_pack_fills_leftover_room_with_whatever_still_fits() -> None:
    runs = [run("a", "ma", [600, 600]), run("b", "mb", [300, 50])]
    chosen = FairPacker(quantum_tokens=64).pack(runs, SchedulerLimits(max_tokens_per_pass=1000))
    assert [r.request_id for r in chosen if r.tenant_id == "b"] == ["mb/1", "mb/2"]
    assert sum(r.num_tokens for r in chosen) == 950


def test_pack_respects_the_adapter_limit_but_keeps_filling_admitted_models() -> None:
    runs = [run("a", "ma1", [10, 10]), run("a", "ma2", [10]), run("b", "mb", [10]), run("c", "mc", [10])]
    limits = SchedulerLimits(max_tokens_per_pass=1000, max_adapters_per_pass=2)
    chosen = FairPacker(quantum_tokens=10).pack(runs, limits)
    assert len({r.model_id for r in chosen}) == 2
    # The models let in take everything they have queued.
    for model in {r.model_id for r in chosen}:
        queued = next(r for r in runs if r[0].model_id == model)
        assert [r for r in chosen if r.model_id == model] == queued


def test_small_tenant_is_not_starved_by_a_tenant_with_ten_times_the_tokens() -> None:
    heavy = [run("heavy", f"h{i}", [1000] * 10) for i in range(10)]
    light = [run("light", "l0", [100])]
    chosen = FairPacker(quantum_tokens=256).pack(heavy + light, SchedulerLimits(max_tokens_per_pass=2048))
    assert any(r.tenant_id == "light" for r in chosen)


def test_backlogged_tenants_share_tokens_in_proportion_to_weight() -> None:
    packer = FairPacker(quantum_tokens=50, weights={TenantId("gold"): 3.0})
    limits = SchedulerLimits(max_tokens_per_pass=400)
    gold, base = run("gold", "mg", [40] * 400), run("base", "mb", [40] * 400)
    served = {"gold": 0, "base": 0}
    for _ in range(30):
        chosen = packer.pack([gold, base], limits)
        for tenant, tokens in tokens_by_tenant(chosen).items():
            served[tenant] += tokens
        gold = [r for r in gold if r not in chosen]
        base = [r for r in base if r not in chosen]
    assert served["gold"] / served["base"] == pytest.approx(3.0, rel=0.1)


def test_equal_weights_share_equally_whatever_the_request_sizes() -> None:
    packer = FairPacker(quantum_tokens=128)
    limits = SchedulerLimits(max_tokens_per_pass=1024)
    big, small = run("big", "mbig", [500] * 200), run("small", "msmall", [20] * 2000)
    served = {"big": 0, "small": 0}
    for _ in range(60):
        chosen = packer.pack([big, small], limits)
        for tenant, tokens in tokens_by_tenant(chosen).items():
            served[tenant] += tokens
        big = [r for r in big if r not in chosen]
        small = [r for r in small if r not in chosen]
    assert served["big"] / served["small"] == pytest.approx(1.0, rel=0.15)


def test_idle_tenant_loses_unused_credit() -> None:
    packer = FairPacker(quantum_tokens=100)
    limits = SchedulerLimits(max_tokens_per_pass=1000)
    packer.pack([run("a", "ma", [30])], limits)
    assert packer.deficit(TenantId("a")) == 70
    packer.pack([run("b", "mb", [30])], limits)
    assert packer.deficit(TenantId("a")) == 0


def test_pack_of_nothing_is_empty() -> None:
    assert FairPacker(quantum_tokens=10).pack([], SchedulerLimits()) == []
    assert FairPacker(quantum_tokens=10).pack([[]], SchedulerLimits()) == []


def test_least_recently_served_tenant_goes_first_when_room_is_short() -> None:
    packer = FairPacker(quantum_tokens=1000)
    limits = SchedulerLimits(max_tokens_per_pass=100)
    a, b = run("a", "ma", [100] * 5), run("b", "mb", [100] * 5)
    winners = []
    for _ in range(4):
        chosen = packer.pack([a, b], limits)
        winners.append(chosen[0].tenant_id)
        a = [r for r in a if r not in chosen]
        b = [r for r in b if r not in chosen]
    assert winners in (["a", "b", "a", "b"], ["b", "a", "b", "a"])


def sample(tenant: str, i: int, t: float) -> QueuedRequest:
    return QueuedRequest(
        RequestId(f"{tenant}/{i}"), TenantId(tenant), ModelId(f"s-{tenant}"), RequestKind.SAMPLE, i, 5, t
    )


def test_sample_batch_round_robins_tenants_oldest_first() -> None:
    queues = {
        TenantId("a"): [sample("a", i, 10.0 + i) for i in range(5)],
        TenantId("b"): [sample("b", i, 1.0 + i) for i in range(2)],
    }
    chosen = pick_sample_batch(queues, max_batch=4)
    assert [r.request_id for r in chosen] == ["b/0", "a/0", "b/1", "a/1"]
    assert len(pick_sample_batch(queues, max_batch=100)) == 7
    assert pick_sample_batch({}, max_batch=4) == []
