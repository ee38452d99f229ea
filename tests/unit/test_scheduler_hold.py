"""Holding a pass (or sample batch) for tenants expected soon: independent closed-loop clients come to share
passes, a lone tenant is never held, a tenant that stops is not waited for again, and no hold outlasts its
budget. Driven by `ClosedLoopSim` (the real `Scheduler` on a simulated clock and engine); all times are
simulated, nothing here is timed."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from services.scheduler import RequestKind, SchedulerLimits, TenantId
from services.scheduler.arrivals import PASS, SAMPLE, ArrivalForecast, Expected, decide_hold
from services.scheduler.simulation import Client, ClosedLoopSim, EngineCost, SimReport, wait_ratio_beside

CPU = EngineCost(fixed_s=0.025, per_token_s=0.0005)
"""This 2-core machine's tiny model, roughly: a 32-token pass 41 ms, a 256-token pass 153 ms."""
TURNAROUND_S = 0.015
"""Result published -> the client's next request at the scheduler (long-poll wake-up, HTTP, SDK)."""
NO_HOLD = SchedulerLimits(hold_factor=0)


def eight_trainers(limits: SchedulerLimits, seconds: float = 20.0) -> tuple[SimReport, ClosedLoopSim]:
    # Staggered starts: independent clients, not a lock-step batch.
    clients = [Client(f"t{i}", 32, TURNAROUND_S, start_s=i * 0.013) for i in range(8)]
    sim = ClosedLoopSim(limits, CPU, clients)
    return sim.run(seconds), sim


def test_independent_trainers_come_to_share_passes() -> None:
    held, _ = eight_trainers(SchedulerLimits())
    unheld, _ = eight_trainers(NO_HOLD)
    assert unheld.mean_tenants_per_pass < 3  # what the service did before: whoever happened to be queued
    assert held.mean_tenants_per_pass > 7.5
    assert held.tokens_per_s > 1.15 * unheld.tokens_per_s
    # Every tenant got its share.
    assert max(held.tokens.values()) - min(held.tokens.values()) <= 32


def test_shared_passes_come_close_to_ideal_lock_step() -> None:
    """Ideal: all eight in every pass, the cycle being one 256-token pass, eight barriers and two turnarounds."""
    held, _ = eight_trainers(SchedulerLimits())
    cycle = CPU.fixed_s + CPU.per_token_s * 256 + 8 * CPU.barrier_s + 2 * TURNAROUND_S
    assert held.tokens_per_s >= 0.9 * 256 / cycle


def test_a_lone_tenant_is_never_held() -> None:
    sim = ClosedLoopSim(SchedulerLimits(), CPU, [Client("solo", 32, TURNAROUND_S)])
    report = sim.run(10.0)
    assert report.holds == 0
    own_pass = CPU.fixed_s + CPU.per_token_s * 32
    assert max(report.latencies["solo"]) == pytest.approx(own_pass)


def test_a_tenant_that_stops_is_not_waited_for_again() -> None:
    sim = ClosedLoopSim(SchedulerLimits(), CPU, [Client("a", 32, TURNAROUND_S), Client("b", 32, TURNAROUND_S)])
    sim.run(5.0)
    sim.stop("b")
    sim.run(0.5)  # b's last requests finish; a may be held once more for it
    holds = sim.report.holds
    before = len(sim.report.latencies["a"])
    sim.run(3.0)
    assert sim.report.holds == holds
    assert statistics.median(sim.report.latencies["a"][before:]) == pytest.approx(CPU.fixed_s + 32 * CPU.per_token_s)


def test_holds_stay_within_their_budget() -> None:
    limits = SchedulerLimits(max_hold_seconds=0.03)
    clients = [Client(f"t{i}", 32, 0.05, start_s=i * 0.013) for i in range(8)]
    sim = ClosedLoopSim(limits, CPU, clients)
    holds: list[float] = []
    step = sim.scheduler.step

    def recording_step():  # type: ignore[no-untyped-def]
        plan = step()
        if plan.hold_s is not None:
            holds.append(plan.hold_s)
        return plan

    sim.scheduler.step = recording_step  # type: ignore[method-assign]
    sim.run(10.0)
    assert holds and max(holds) <= 0.03 + 1e-9


def test_no_hold_while_a_full_pass_is_queued() -> None:
    """A pass holds at most `max_adapters_per_pass` models: with that many queued nobody could join it, so
    waiting would only idle the engine (at 512 tenants hundreds of models are queued)."""
    limits = SchedulerLimits(max_adapters_per_pass=4)
    clients = [Client(f"t{i}", 32, TURNAROUND_S, start_s=i * 0.013) for i in range(8)]
    sim = ClosedLoopSim(limits, CPU, clients)
    held_with: list[int] = []
    step = sim.scheduler.step

    def recording_step():  # type: ignore[no-untyped-def]
        plan = step()
        if plan.hold_s is not None:  # nothing was dispatched: the queue is what the hold decision saw
            held_with.append(len(sim.scheduler.stats().queued_by_model))
        return plan

    sim.scheduler.step = recording_step  # type: ignore[method-assign]
    sim.run(10.0)
    assert held_with and max(held_with) < limits.max_adapters_per_pass


def test_a_tiny_hold_budget_keeps_the_old_behaviour() -> None:
    report, _ = eight_trainers(SchedulerLimits(max_hold_seconds=0.0005))
    assert report.mean_tenants_per_pass < 3


def test_sampling_clients_come_to_share_batches() -> None:
    def run(limits: SchedulerLimits) -> SimReport:
        clients = [Client(f"s{i}", 32, TURNAROUND_S, sampling=True, start_s=i * 0.021) for i in range(8)]
        return ClosedLoopSim(limits, CPU, clients).run(20.0)

    held, unheld = run(SchedulerLimits()), run(NO_HOLD)
    assert statistics.mean(unheld.sample_batch_sizes) <= 4.5  # as measured through the service: 4 of 8
    assert statistics.mean(held.sample_batch_sizes) > 7.5


def light_beside_heavy(cost: EngineCost, *, pipelined: bool) -> tuple[float, SimReport]:
    """bench/fairness.py's case: a light tenant (64 tokens a step, an SDK client's turnaround) beside a heavy
    one (ten models of 64 tokens back to back). Returns the light tenant's median wait beside the heavy one
    over its median wait alone, and the report of the shared run."""
    light = Client("light", 64, TURNAROUND_S, pipelined=pipelined)
    heavy = Client("heavy", 64, 0.001, models=10, pipelined=pipelined)
    return wait_ratio_beside(SchedulerLimits(), cost, light, [heavy], seconds=20.0, alone_seconds=10.0)


@pytest.mark.parametrize("pipelined", [False, True])
def test_beside_a_heavy_backlog_the_light_tenant_rides_along_rather_than_takes_turns(pipelined: bool) -> None:
    """On this CPU shape (fixed cost below 64 tokens' worth) a pass paced to 1.5x the light tenant's own
    holds one request. The two would take turns, and the light tenant would wait a whole heavy pass every
    step (about 2x its wait alone, as before RIDE_ALONG_REQUESTS). With room for one heavy request beside it
    and a hold for it, it rides along: its wait is its own pass with one more request in it. (Pipelined, this
    seed also pins the packer's turn order after a top-up: the light tenant, back with no credit, lost every
    other pass to the heavy one's leftover credit, 3.1x.)"""
    ratio, shared = light_beside_heavy(CPU, pipelined=pipelined)
    pass_s = CPU.fixed_s + 64 * CPU.per_token_s
    two_s = CPU.fixed_s + 128 * CPU.per_token_s
    assert ratio <= 1.05 * two_s / pass_s < 1.7
    assert shared.holds > 0
    assert shared.tokens["heavy"] > 5 * 64 / shared.seconds  # the heavy tenant keeps progressing


THIS_BOX = EngineCost(fixed_s=0.0166, per_token_s=0.000185)
"""A fit bench/fairness.py's pacer made on this machine (2026-12-05): fixed cost worth 90 tokens, so a paced
pass beside a 64-token tenant holds two requests (~41 ms)."""


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_light_sdk_client_is_waited_for_over_its_turnaround(pipelined: bool) -> None:
    """An SDK client's turnaround (15 ms) is over a quarter of a ~41 ms paced pass: a hold of at most a
    quarter (the earlier HEAVY_HOLD_SHARE) never covered it, so the light tenant came back just after the next
    pass started and waited it out every step (2.4-2.6x its wait alone). Half a pass covers it."""
    ratio, shared = light_beside_heavy(THIS_BOX, pipelined=pipelined)
    assert ratio <= 1.5
    assert shared.holds > 0


GPU_LIKE = EngineCost(fixed_s=0.03, per_token_s=0.00002)
"""Fixed cost dominant: a paced pass beside a 64-token tenant holds ~850 tokens (the light one and a dozen
heavy requests)."""


def test_beside_a_heavy_backlog_a_pass_waits_briefly_for_a_light_tenant_that_can_ride_along() -> None:
    """When a paced pass has room for the light tenant beside the heavy one, a closed-loop light tenant
    comes back just after the pass planned at its barrier started and would wait all of it out. A hold of at
    most a quarter of that pass lets it ride in it instead: its latency falls, and the heavy tenant loses
    nothing (it rides along in the same passes)."""
    def run(limits: SchedulerLimits) -> tuple[float, int, int]:
        clients = [Client("light", 64, 0.003), Client("heavy", 64, 0.001, models=10)]
        report = ClosedLoopSim(limits, GPU_LIKE, clients).run(20.0)
        return statistics.median(report.latencies["light"]), report.tokens["heavy"], report.holds

    held, held_heavy, holds = run(SchedulerLimits())
    unheld, unheld_heavy, _ = run(NO_HOLD)
    assert holds > 0
    assert held < 0.75 * unheld
    assert held_heavy >= unheld_heavy


# -- the forecast on its own ------------------------------------------------------------------------------
T = TenantId("t")


def test_after_a_pass_the_next_pass_request_is_two_turnarounds_away() -> None:
    forecast = ArrivalForecast()
    now = 0.0
    for _ in range(3):  # fb -> (10 ms) -> optim -> (20 ms) -> fb
        forecast.arrived(T, RequestKind.FORWARD_BACKWARD, now)
        now += 0.05
        forecast.completed(T, RequestKind.FORWARD_BACKWARD, now, idle=True)
        now += 0.010
        forecast.arrived(T, RequestKind.OPTIM_STEP, now)
        now += 0.001
        forecast.completed(T, RequestKind.OPTIM_STEP, now, idle=True)
        now += 0.020
    forecast.arrived(T, RequestKind.FORWARD_BACKWARD, now)
    forecast.completed(T, RequestKind.FORWARD_BACKWARD, now + 0.05, idle=True)
    expected = forecast.expected(PASS, now + 0.05, ready=())
    assert expected[T].due == pytest.approx(now + 0.05 + 0.030)
    # Its optim_step queued or running: the next pass request follows one turnaround after it.
    assert forecast.expected(PASS, now + 0.06, ready=(), barrier_pending=[T])[T].due == pytest.approx(now + 0.08)
    # Queued already: not expected. A sampling lane it never used: not expected either.
    assert forecast.expected(PASS, now + 0.05, ready=[T]) == {}
    assert forecast.expected(SAMPLE, now + 0.05, ready=()) == {}


def test_a_late_tenant_is_no_longer_expected_and_a_new_one_borrows_everyones_gaps() -> None:
    forecast = ArrivalForecast(slack=0.5)
    forecast.arrived(T, RequestKind.SAMPLE, 0.0)
    forecast.completed(T, RequestKind.SAMPLE, 1.0, idle=True)
    forecast.arrived(T, RequestKind.SAMPLE, 1.1)
    forecast.completed(T, RequestKind.SAMPLE, 2.0, idle=True)
    assert forecast.expected(SAMPLE, 2.0, ready=())[T].due == pytest.approx(2.1)
    assert T in forecast.expected(SAMPLE, 2.14, ready=())  # within the slack (half the 0.1 s turnaround)
    assert forecast.expected(SAMPLE, 2.16, ready=()) == {}
    newcomer = TenantId("new")
    forecast.arrived(newcomer, RequestKind.SAMPLE, 2.5)
    forecast.completed(newcomer, RequestKind.SAMPLE, 3.0, idle=True)
    assert forecast.expected(SAMPLE, 3.0, ready=())[newcomer].due == pytest.approx(3.1)
    forecast.forget_idle(3.0 + 10)
    assert forecast.expected(SAMPLE, 13.0, ready=()) == {}


def test_decide_hold_waits_for_the_last_tenant_due_within_the_budget() -> None:
    expected = {TenantId("a"): Expected(1.01, 1.015), TenantId("b"): Expected(1.02, 1.03),
                TenantId("far"): Expected(2.0, 2.5)}
    decision = decide_hold(expected, now=1.0, held_since=1.0, budget_s=0.05)
    assert decision.hold_s == pytest.approx(0.03)
    assert decision.waiting_for == {"a", "b"}
    assert decide_hold(expected, now=1.05, held_since=1.0, budget_s=0.05).hold_s is None  # budget spent
    assert decide_hold({}, now=1.0, held_since=1.0, budget_s=0.05).hold_s is None


def test_the_settings_reach_the_scheduler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.embedded import _scheduler
    from deploy.settings import ServiceSettings

    default = _scheduler(ServiceSettings(data_dir=tmp_path)).limits
    assert (default.hold_factor, default.max_hold_seconds) == (SchedulerLimits.hold_factor,
                                                               SchedulerLimits.max_hold_seconds)
    monkeypatch.setenv("CARPOOL_HOLD_FACTOR", "0")
    monkeypatch.setenv("CARPOOL_MAX_HOLD_MS", "40")
    limits = _scheduler(ServiceSettings(data_dir=tmp_path)).limits
    assert (limits.hold_factor, limits.max_hold_seconds) == (0, 0.04)
    with pytest.raises(ValueError):
        ServiceSettings(data_dir=tmp_path, hold_factor=-1)
