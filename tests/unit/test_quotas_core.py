"""Quota building blocks without services: the in-process token bucket and markers, the gate's decisions,
the saturation rule, and the reaper that consumes seq ids whose refused submissions were abandoned."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from services.auth.tenants import Tenant
from services.control.api import Invalid, QuotaExceeded
from services.control.quota_store import InProcessQuotaStore
from services.control.quotas import QuotaGate, QuotaOptions, queued_seconds
from services.db.ids import ModelId, TenantId
from services.db.tenants import TenantQuotas


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tenant(name: str = "t", **quotas: int | None) -> Tenant:
    return Tenant(TenantId(f"tenant-{name}"), name, False, TenantQuotas(**quotas))


def test_bucket_grants_up_to_capacity_then_says_exactly_when_the_rest_fits() -> None:
    clock = FakeClock()
    store = InProcessQuotaStore(clock)
    assert store.take("k", 600, capacity=1000, window_s=60) == 0.0
    assert store.take("k", 600, capacity=1000, window_s=60) == pytest.approx(200 / (1000 / 60))  # 12 s
    clock.now += 11.9
    assert store.take("k", 600, capacity=1000, window_s=60) > 0  # a refusal takes nothing...
    clock.now += 0.1
    assert store.take("k", 600, capacity=1000, window_s=60) == 0.0  # ...so the hint was exact
    clock.now += 3600
    assert store.take("k", 1000, capacity=1000, window_s=60) == 0.0  # refills to capacity, not beyond
    assert store.take("k", 1, capacity=1000, window_s=60) > 0


def test_buckets_are_per_key_and_follow_a_changed_limit() -> None:
    clock = FakeClock()
    store = InProcessQuotaStore(clock)
    assert store.take("a", 100, capacity=100, window_s=1) == 0.0
    clock.now += 0.5
    assert store.take("a", 50, capacity=50, window_s=1) == pytest.approx((50 - 25) / 50)  # refilled 25 of 50
    assert store.take("b", 10, capacity=50, window_s=1) == 0.0  # untouched: full, at the new capacity
    assert store.take("b", 45, capacity=50, window_s=1) == pytest.approx((45 - 40) / 50)


def test_markers_expire() -> None:
    clock = FakeClock()
    store = InProcessQuotaStore(clock)
    store.mark("m", 5)
    assert store.marked("m") and not store.marked("other")
    clock.now += 5.01
    assert not store.marked("m")


def test_gate_charges_tokens_against_the_tenant_limit_or_the_default() -> None:
    clock = FakeClock()
    gate = QuotaGate(QuotaOptions(default_tokens_per_minute=100), InProcessQuotaStore(clock))
    limited = tenant("own", tokens_per_minute=10)
    gate.charge_tokens(limited, 10)
    with pytest.raises(QuotaExceeded) as refused:
        gate.charge_tokens(limited, 5)
    assert refused.value.retry_after_s == pytest.approx(5 / (10 / 60))
    with pytest.raises(Invalid, match="more than tenant own's limit of 10 tokens per minute"):
        gate.charge_tokens(limited, 11)  # could never fit: not worth a retry
    gate.charge_tokens(tenant("default"), 100)  # the server default applies to tenants without a limit
    with pytest.raises(QuotaExceeded):
        gate.charge_tokens(tenant("default"), 1)
    QuotaGate().charge_tokens(tenant("free"), 10**9)  # no limit anywhere: nothing to check
    gate.charge_tokens(limited, 0)  # optim_step, saves: no tokens, never refused


def test_window_is_configurable_so_tests_need_not_wait_a_minute() -> None:
    clock = FakeClock()
    gate = QuotaGate(QuotaOptions(token_window_s=2.0), InProcessQuotaStore(clock))
    t = tenant(tokens_per_minute=100)
    gate.charge_tokens(t, 100)
    with pytest.raises(QuotaExceeded) as refused:
        gate.charge_tokens(t, 50)
    assert refused.value.retry_after_s == pytest.approx(1.0)


def test_capacity_state() -> None:
    gate = QuotaGate(QuotaOptions(saturation_queue_depth=10, saturation_wait_s=5.0))
    assert gate.capacity_state(queued_for_s=None, backlog=1000) == "active"  # running: not paused
    assert gate.capacity_state(queued_for_s=1.0, backlog=3) == "active"
    assert gate.capacity_state(queued_for_s=1.0, backlog=10) == "paused_capacity"
    assert gate.capacity_state(queued_for_s=5.0, backlog=None) == "paused_capacity"
    off = QuotaGate(QuotaOptions(saturation_queue_depth=None, saturation_wait_s=None))
    assert off.capacity_state(queued_for_s=1e6, backlog=10**6) == "active"


def test_queued_seconds_counts_only_requests_that_have_not_started() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert queued_seconds("queued", now - timedelta(seconds=7), now) == 7.0
    assert queued_seconds("running", now - timedelta(seconds=7), now) is None


def _reaper_gate() -> QuotaGate:
    return QuotaGate(QuotaOptions(sdk_retry_gap_s=0.05, abandon_grace_s=0.05))


async def _until(condition: Callable[[], object], timeout_s: float = 30.0) -> None:
    """Let the loop run until `condition()` holds (explicit, instead of sleeping for a guessed time)."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def _reaper_idle(gate: QuotaGate) -> bool:
    """No timer left to fire and no reap still running: whatever the reaper would do, it has done."""
    reaper = gate._reaper
    return not reaper._timers and not reaper._tasks


def test_a_refused_seq_id_that_is_never_retried_is_consumed() -> None:
    consumed: list[tuple[str, int, str]] = []

    async def consume(_t: Tenant, model_id: ModelId, seq_id: int, error: str) -> None:
        consumed.append((model_id, seq_id, error))

    async def scenario() -> None:
        gate = _reaper_gate()
        gate.refused(tenant(), ModelId("m"), 3, retry_after_s=0.01, consume=consume)
        await asyncio.sleep(0)
        assert consumed == []  # still within the retry horizon
        await _until(lambda: _reaper_idle(gate))

    asyncio.run(scenario())
    assert [(m, s) for m, s, _ in consumed] == [("m", 3)]
    assert "seq_id was consumed" in consumed[0][2]


def test_a_refused_seq_id_that_keeps_being_retried_is_left_alone() -> None:
    consumed: list[int] = []

    async def consume(_t: Tenant, _m: ModelId, seq_id: int, _e: str) -> None:
        consumed.append(seq_id)

    async def scenario() -> None:
        gate = _reaper_gate()
        for _ in range(6):  # the SDK retries every 50 ms, each refused again
            gate.refused(tenant(), ModelId("m"), 1, retry_after_s=0.01, consume=consume)
            await asyncio.sleep(0.05)
        assert consumed == []
        # then it stops retrying (gave up, or was accepted: consuming is a no-op then)
        await _until(lambda: _reaper_idle(gate))

    asyncio.run(scenario())
    assert consumed == [1]


def test_a_retry_seen_by_another_process_keeps_the_seq_id_alive() -> None:
    """The marker lives in the shared store: a refusal elsewhere renews it, and this timer then stands down."""
    consumed: list[int] = []
    store = InProcessQuotaStore()

    async def consume(_t: Tenant, _m: ModelId, seq_id: int, _e: str) -> None:
        consumed.append(seq_id)

    async def scenario() -> None:
        here = QuotaGate(QuotaOptions(sdk_retry_gap_s=0.05, abandon_grace_s=0.05), store)
        here.refused(tenant(), ModelId("m"), 1, retry_after_s=0.01, consume=consume)
        store.mark("refused:m:1", 10.0)  # another gateway refused a retry (before this timer fires)
        await _until(lambda: _reaper_idle(here))  # the timer fired, found the marker and stood down

    asyncio.run(scenario())
    assert consumed == []


def test_service_settings_reach_the_control_plane_and_the_scheduler(tmp_path: Path) -> None:
    from deploy.embedded import _control_options, _scheduler
    from deploy.settings import ServiceSettings

    settings = ServiceSettings(data_dir=tmp_path, default_tokens_per_minute=1000, default_max_concurrent_requests=4,
                               quota_window_seconds=2, saturation_queue_depth=9, saturation_wait_seconds=None,
                               max_pass_ms=250)
    quotas = _control_options(settings).quotas
    assert (quotas.default_tokens_per_minute, quotas.default_max_concurrent_requests) == (1000, 4)
    assert (quotas.token_window_s, quotas.saturation_queue_depth, quotas.saturation_wait_s) == (2, 9, None)
    assert _scheduler(settings).limits.max_pass_seconds == 0.25
    assert _scheduler(ServiceSettings(data_dir=tmp_path)).limits.max_pass_seconds is None
