"""`PassCostModel` and `PassPacer`: fitting a pass's fixed and per-token cost from observed passes, and turning
contention into a token budget (pure: durations are handed in, no clock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.scheduler import PassCostModel, PassPacer, SchedulerLimits
from services.scheduler.pacing import DEFAULT_PASS_LATENCY_FACTOR

CPU = (0.002, 0.0003)
"""(fixed s, s per token): a pass costs mostly per token (compute-bound on a few CPU cores)."""
GPU = (0.030, 0.000002)
"""A pass costs mostly a fixed amount (an accelerator that a small batch does not fill)."""
MIXED = [640, 64, 128] * 4
"""Passes of different sizes: enough pairs for a fit."""


def observe(model: PassCostModel | PassPacer, cost: tuple[float, float], sizes: list[int]) -> None:
    fixed, per_token = cost
    for tokens in sizes:
        model.observe(tokens, fixed + per_token * tokens)


def fitted_pacer(cost: tuple[float, float], *, factor: float = 2, max_pass_seconds: float | None = None) -> PassPacer:
    pacer = PassPacer(max_pass_seconds, factor)
    observe(pacer, cost, MIXED)
    return pacer


def test_the_model_separates_fixed_and_per_token_cost_once_pass_sizes_differ() -> None:
    model = PassCostModel()
    assert model.cost() is None and model.estimate(64) is None
    observe(model, CPU, MIXED)
    fixed, per_token = model.cost() or (0, 0)
    assert fixed == pytest.approx(CPU[0]) and per_token == pytest.approx(CPU[1])
    assert model.estimate(100) == pytest.approx(CPU[0] + CPU[1] * 100)


def test_without_passes_of_different_sizes_there_is_no_fit() -> None:
    model = PassCostModel()
    observe(model, GPU, [100] * 30)
    assert model.cost() is None and model.typical_tokens() == 100


def test_the_first_pass_is_warm_up_and_not_used() -> None:
    model = PassCostModel()
    model.observe(640, 5.0)
    observe(model, CPU, MIXED)
    assert model.cost() == pytest.approx(CPU)


def test_the_model_keeps_its_slope_while_sizes_stay_put_and_follows_a_slower_machine() -> None:
    model = PassCostModel()
    observe(model, CPU, MIXED)
    observe(model, CPU, [128] * 30)  # paced passes of one size: nothing left to re-fit the slope from
    assert model.cost() == pytest.approx(CPU)
    slower = (CPU[0] * 1.5, CPU[1] * 1.5)
    observe(model, slower, [128] * 30)
    fixed, per_token = model.cost() or (0, 0)
    assert per_token == pytest.approx(CPU[1])  # still the last fit
    assert model.estimate(128) == pytest.approx(slower[0] + slower[1] * 128)


def test_stalled_passes_do_not_move_the_fit() -> None:
    model = PassCostModel()
    observe(model, GPU, [25, 52, 13, 27, 52, 14] * 2)
    model.observe(14, 1.1)  # the machine stalled: 40 times a normal pass
    model.observe(52, 0.6)
    observe(model, GPU, [52, 25])
    fixed, per_token = model.cost() or (0, 0)
    assert fixed == pytest.approx(GPU[0], rel=0.01) and per_token == pytest.approx(GPU[1], rel=0.01)


def test_noise_never_makes_a_pass_cheaper_for_more_tokens() -> None:
    model = PassCostModel()
    for tokens, seconds in [(100, 0.05), (1000, 0.04)] * 6:
        model.observe(tokens, seconds)
    fixed, per_token = model.cost() or (0, 1)
    assert per_token == 0 and fixed == pytest.approx(0.045, rel=0.15)
    model.observe(0, 1.0)  # empty or untimed passes say nothing
    model.observe(10, 0.0)
    assert model.cost() == (fixed, per_token)


def test_on_a_cpu_a_contended_pass_holds_a_few_times_the_smallest_tenants_work() -> None:
    pacer = fitted_pacer(CPU, factor=2)
    # f * n + (f - 1) * fixed / per_token: the pass takes twice the 64-token tenant's own pass.
    assert pacer.budget(32768, 64) == 2 * 64 + 6
    assert pacer.target_s(64) == pytest.approx(2 * (CPU[0] + CPU[1] * 64))
    assert pacer.budget(32768, 8) == 2 * 8 + 6  # a smaller tenant sets a faster pace
    assert pacer.budget(100, 64) == 100  # never above the hard limit


def test_factor_one_fits_exactly_the_smallest_tenants_work() -> None:
    assert fitted_pacer(CPU, factor=1).budget(32768, 64) == 64


def test_on_a_gpu_contended_passes_stay_large() -> None:
    pacer = fitted_pacer(GPU, factor=2)
    assert pacer.budget(32768, 64) == 2 * 64 + 15000  # a 64-token pass is mostly fixed cost: 30 ms
    assert pacer.budget(4096, 64) == 4096


def test_without_a_fit_passes_stay_full_but_every_few_probe_a_smaller_size() -> None:
    pacer = PassPacer(None, 2, probe_every=4)
    assert [pacer.budget(32768, 64) for _ in range(4)] == [32768] * 4  # nothing measured: nothing to halve
    observe(pacer, GPU, [640] * 10)
    assert [pacer.budget(32768, 64) for _ in range(4)] == [32768, 32768, 32768, 320]
    observe(pacer, GPU, [640])  # only a big request was queued: it ran whole, so the probe goes on
    assert pacer.budget(32768, 64) == 320
    observe(pacer, GPU, [300])  # the probe ran: 11 pairs of different sizes, a fit
    assert pacer.budget(32768, 64) == 2 * 64 + 15000


def test_a_probe_that_cannot_run_small_ends_after_a_few_passes() -> None:
    pacer = PassPacer(None, 2, probe_every=4)
    observe(pacer, GPU, [640] * 10)  # one request per pass: nothing can run at half the size
    budgets = [pacer.budget(32768, 640) for _ in range(12)]
    assert budgets == [32768] * 3 + [320] * 4 + [32768] * 4 + [320]


def test_factor_zero_turns_pacing_off_and_an_explicit_target_overrides_the_factor() -> None:
    off = fitted_pacer(CPU, factor=0)
    assert not off.enabled and off.budget(32768, 64) == 32768
    explicit = fitted_pacer(CPU, factor=2, max_pass_seconds=0.05)
    assert explicit.enabled and explicit.budget(32768, 64) == 160  # (0.05 - 0.002) / 0.0003
    observe(explicit, GPU, MIXED * 3)
    assert explicit.budget(32768, 64) == 10000  # the fit followed the faster engine: (0.05 - 0.03) / 2e-6


def test_a_target_below_the_fixed_cost_leaves_one_request_per_pass() -> None:
    pacer = PassPacer(max_pass_seconds=0.01, latency_factor=0)
    for tokens in [100, 1000] * 6:
        pacer.observe(tokens, 0.05)  # no per-token cost measured: every pass costs 50 ms
    assert pacer.budget(32768, 64) == 1


def test_limits_reject_a_negative_factor_and_pace_by_default() -> None:
    with pytest.raises(ValueError, match="pass_latency_factor"):
        SchedulerLimits(pass_latency_factor=-1)
    assert SchedulerLimits().pass_latency_factor > 0
    assert SchedulerLimits().max_pass_seconds is None


def test_the_setting_reaches_the_scheduler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.embedded import _scheduler
    from deploy.settings import ServiceSettings

    assert _scheduler(ServiceSettings(data_dir=tmp_path)).limits.pass_latency_factor == DEFAULT_PASS_LATENCY_FACTOR
    monkeypatch.setenv("CARPOOL_PASS_LATENCY_FACTOR", "0")
    assert _scheduler(ServiceSettings(data_dir=tmp_path)).limits.pass_latency_factor == 0
    with pytest.raises(ValueError):
        ServiceSettings(data_dir=tmp_path, pass_latency_factor=-1)
