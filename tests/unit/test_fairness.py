"""Fairness of the scheduler beside a heavy tenant: a light tenant's requests land in the next pass, a newly
backlogged tenant is not held back by another's leftover credit (not even from passes of one request), and
pacing (by default `pass_latency_factor`, or an explicit `max_pass_seconds`) keeps passes short enough while
tenants contend that a request arriving mid-pass waits a bounded time; a tenant alone, or an engine whose
passes cost mostly a fixed amount (a GPU), keeps full passes. Simulated with a fake clock and a linear pass
cost."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable

import pytest

from services.scheduler import (
    ModelId,
    PassPacer,
    QueuedRequest,
    RequestId,
    RequestKind,
    Scheduler,
    SchedulerLimits,
    TenantId,
)
from services.scheduler.policy import FairPacker
from services.scheduler.scheduler import RIDE_ALONG_REQUESTS

FIXED_S, PER_TOKEN_S = 0.002, 0.0003
"""The simulated engine: a pass costs a fixed part plus a part per token (compute-bound, like 2 CPU cores)."""

UNPACED = SchedulerLimits(max_tokens_per_pass=32768, pass_latency_factor=0, hold_factor=0)


def pass_cost(tokens: int) -> float:
    return FIXED_S + PER_TOKEN_S * tokens


def gpu_pass_cost(tokens: int) -> float:
    """A pass on an accelerator: mostly fixed cost (launches, optimizer-free forward/backward of a small batch)."""
    return 0.030 + 0.000002 * tokens


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Sim:
    """Closed-loop training clients on one scheduler: each model re-submits as soon as its request ends."""

    def __init__(self, limits: SchedulerLimits, cost: Callable[[int], float] = pass_cost) -> None:
        self.cost = cost
        self.clock = Clock()
        self.scheduler = Scheduler(limits, clock=self.clock)
        self.next_seq: dict[str, int] = defaultdict(lambda: 1)
        self.sizes: dict[str, int] = {}
        self.tenant_of: dict[str, str] = {}
        self.submitted_at: dict[str, float] = {}
        self.waits: dict[str, list[float]] = defaultdict(list)
        self.passes_waited: dict[str, list[int]] = defaultdict(list)
        self.tokens: dict[str, int] = defaultdict(int)
        self.pass_tokens: list[int] = []
        self._submitted_pass: dict[str, int] = {}
        self.stopped: set[str] = set()
        """Models that do not submit again."""

    def add(self, tenant: str, model: str, tokens: int) -> None:
        self.sizes[model], self.tenant_of[model] = tokens, tenant
        self.scheduler.open_model(ModelId(model), next_seq_id=1)  # created already: training starts at seq 1
        self.submit(model)

    def submit(self, model: str) -> None:
        seq = self.next_seq[model]
        self.next_seq[model] += 1
        request_id = f"{model}#{seq}"
        self.submitted_at[request_id] = self.clock.now
        self._submitted_pass[request_id] = len(self.pass_tokens)
        self.scheduler.submit(QueuedRequest(RequestId(request_id), TenantId(self.tenant_of[model]), ModelId(model),
                                            RequestKind.FORWARD_BACKWARD, seq, self.sizes[model], self.clock.now))

    def run(self, passes: int, *, late: frozenset[str] = frozenset()) -> None:
        """Run `passes` passes. Models in `late` re-submit only after the next pass was planned (they learn
        of their result a moment after the loop moved on): the worst case for their wait."""
        deferred: list[str] = []
        for _ in range(passes):
            plan = self.scheduler.step()
            for model in deferred:
                self.submit(model)
            deferred = []
            for item in plan.passes:
                self.clock.now += self.cost(item.num_tokens)
                self.pass_tokens.append(item.num_tokens)
                for completion in self.scheduler.complete(item, [object()] * len(item.requests)):
                    request_id, model = completion.request_id, completion.request.model_id
                    self.waits[self.tenant_of[model]].append(self.clock.now - self.submitted_at.pop(request_id))
                    self.passes_waited[self.tenant_of[model]].append(
                        len(self.pass_tokens) - self._submitted_pass.pop(request_id))
                    self.tokens[self.tenant_of[model]] += completion.request.num_tokens
                    if model in self.stopped:
                        continue
                    (deferred.append(model) if model in late else self.submit(model))


def test_a_newly_backlogged_tenant_is_not_held_back_by_another_tenants_leftover_credit() -> None:
    """Under small paced passes, credit saved up under large ones must not keep the newcomer out for long."""
    packer = FairPacker(quantum_tokens=2048)

    def req(tenant: str, model: str, seq: int, tokens: int = 64) -> QueuedRequest:
        return QueuedRequest(RequestId(f"{model}#{seq}"), TenantId(tenant), ModelId(model), RequestKind.FORWARD,
                             seq, tokens)

    other_model = [req("heavy", "h2", 1)]
    heavy = [req("heavy", "h1", i) for i in range(1, 400)]
    one_adapter = SchedulerLimits(max_tokens_per_pass=4096, max_adapters_per_pass=1)
    chosen = packer.pack([other_model, heavy], one_adapter)  # the adapter limit stops it early
    heavy = [r for r in heavy if r not in chosen]
    assert packer.deficit(TenantId("heavy")) > 1000  # a big quantum, mostly unspent
    light = [req("light", "l", 1)]
    limits = SchedulerLimits(max_tokens_per_pass=4096)
    waited = 0
    while light[0] not in chosen and waited < 40:
        chosen = packer.pack([other_model, heavy, light], limits, token_budget=64)
        heavy = [r for r in heavy if r not in chosen]
        waited += 1
    assert waited <= 2  # without the cap on carried credit: ~30 passes of heavy's leftover 2000 tokens


def test_a_big_request_is_not_starved_by_a_tenant_sending_tiny_ones() -> None:
    packer = FairPacker(quantum_tokens=2048)
    limits = SchedulerLimits(max_tokens_per_pass=4096)
    big = QueuedRequest(RequestId("b1"), TenantId("big"), ModelId("b"), RequestKind.FORWARD, 1, 2000)
    for i in range(1, 1000):
        tiny = [QueuedRequest(RequestId(f"t{i}"), TenantId("tiny"), ModelId("t"), RequestKind.FORWARD, i, 10)]
        if big in packer.pack([[big], tiny], limits, token_budget=40):
            break
    # Token-fair: the big request runs once tiny has had about as many tokens (2000 / 10 passes of 10)...
    assert 2000 / 10 / 2 <= i <= 2000 / 10 * 2
    # ...while a tenant that goes idle between its tiny requests does not keep it out at all.
    for i in range(1, 1000):
        tiny = [QueuedRequest(RequestId(f"u{i}"), TenantId("tiny"), ModelId("t"), RequestKind.FORWARD, i, 10)]
        chosen = packer.pack([[big], tiny], limits, token_budget=40) + packer.pack([[big]], limits, token_budget=40)
        if big in chosen:
            break
    assert i == 1


def test_pacer_settles_where_a_pass_takes_the_target() -> None:
    pacer = PassPacer(max_pass_seconds=0.05, latency_factor=0)
    assert pacer.budget(32768, 64) == 32768  # nothing measured yet
    budget = 32768
    for _ in range(40):
        pacer.observe(budget, pass_cost(budget))
        budget = pacer.budget(32768, 64)
    assert pass_cost(budget) == pytest.approx(0.05, rel=0.05)
    assert PassPacer(None, 0).budget(100, 10) == 100


def test_without_pacing_passes_fill_the_token_budget() -> None:
    sim = Sim(SchedulerLimits(max_tokens_per_pass=4096, pass_latency_factor=0))
    for i in range(10):
        sim.add("heavy", f"h{i}", 64)
    sim.add("light", "l", 64)
    sim.run(20)
    assert set(sim.pass_tokens) == {11 * 64}  # everything queued goes into every pass


def test_a_request_larger_than_the_paced_budget_still_runs_alone() -> None:
    sim = Sim(SchedulerLimits(max_tokens_per_pass=4096, max_pass_seconds=0.01))
    sim.add("heavy", "h", 2000)  # ~0.6 s a pass, far over the target
    sim.add("light", "l", 10)
    sim.run(400)
    assert sim.pass_tokens[0] == 2010  # nothing measured yet: the first pass is full
    assert sorted(set(sim.pass_tokens[-300:])) == [10, 2000]  # then paced: never together, yet each runs


def test_pacing_applies_only_while_tenants_contend() -> None:
    sim = Sim(SchedulerLimits(max_tokens_per_pass=32768, max_pass_seconds=pass_cost(64)))
    for i in range(10):
        sim.add("heavy", f"h{i}", 64)
    sim.run(20)
    assert set(sim.pass_tokens[-10:]) == {640}  # alone: full passes, however long they take
    sim.add("light", "l", 64)
    sim.run(20)
    assert max(sim.pass_tokens[-10:]) <= 128  # light trains too: paced
    sim.stopped.add("l")  # light's training loop ends
    sim.run(5)
    sim.clock.now += 6.0
    sim.run(20)
    assert set(sim.pass_tokens[-10:]) == {640}  # contention over: full passes again


def light_wait_ratio(limits: SchedulerLimits, heavy_models: int, heavy_tokens: int,
                     cost: Callable[[int], float] = pass_cost) -> tuple[float, float, Sim]:
    """(light's median wait beside heavy / light's median wait alone, heavy's tokens per second, the sim)."""
    alone = Sim(limits, cost)
    alone.add("light", "l", 64)
    alone.run(30, late=frozenset({"l"}))
    sim = Sim(limits, cost)
    for i in range(heavy_models):
        sim.add("heavy", f"h{i}", heavy_tokens)
    sim.run(50)  # heavy's backlog and the pacer settle
    sim.add("light", "l", 64)
    start, heavy_before = sim.clock.now, sim.tokens["heavy"]
    sim.run(300, late=frozenset({"l"}))
    ratio = statistics.median(sim.waits["light"]) / statistics.median(alone.waits["light"])
    return ratio, (sim.tokens["heavy"] - heavy_before) / (sim.clock.now - start), sim


def test_light_tenant_lands_in_the_next_pass_beside_ten_times_the_tokens() -> None:
    limits = SchedulerLimits(max_tokens_per_pass=32768, max_pass_seconds=pass_cost(64))
    _, heavy_rate, sim = light_wait_ratio(limits, heavy_models=10, heavy_tokens=64)
    assert max(sim.passes_waited["light"]) <= 2  # the pass running when it arrived, then its own
    assert heavy_rate > 0


def test_max_pass_seconds_bounds_the_light_tenants_wait_at_a_small_cost_to_the_heavy_one() -> None:
    unpaced, unpaced_rate, _ = light_wait_ratio(UNPACED, 10, 64)
    paced, paced_rate, sim = light_wait_ratio(
        SchedulerLimits(max_tokens_per_pass=32768, max_pass_seconds=pass_cost(64)), 10, 64)
    assert unpaced > 4  # full passes: it waits for one, then runs inside another (11 requests each)
    assert paced <= 2.2  # a running pass of about its own size, then its own
    # Heavy keeps progressing; it gives up what light now gets: light, no longer waiting on whole passes,
    # sends as often as heavy's models do and so takes its equal share of the passes it is in.
    assert paced_rate > 0.4 * unpaced_rate
    assert sim.tokens["light"] <= sim.tokens["heavy"]


def test_a_step_runs_its_passes_before_its_barriers() -> None:
    """Ten heavy models' optim_steps must not delay the light tenant's pass planned in the same step."""
    scheduler = Scheduler(SchedulerLimits())
    for i in range(10):
        scheduler.open_model(ModelId(f"h{i}"), next_seq_id=1)
        scheduler.submit(QueuedRequest(RequestId(f"h{i}#1"), TenantId("heavy"), ModelId(f"h{i}"),
                                       RequestKind.OPTIM_STEP, 1))
    scheduler.open_model(ModelId("l"), next_seq_id=1)
    scheduler.submit(QueuedRequest(RequestId("l#1"), TenantId("light"), ModelId("l"), RequestKind.FORWARD, 1, 64))
    plan = scheduler.step()
    assert len(plan.barriers) == 10 and len(plan.passes) == 1
    assert plan.items[0] is plan.passes[0]


def test_the_last_passs_barriers_run_before_the_next_pass_and_other_barriers_after_it() -> None:
    """The models that were in the pass that just completed have their adapters on the device: their
    optim_steps run before the next pass (which would evict them when adapters outnumber the resident slots,
    and each step would bring its adapter back), and their clients get the step's result sooner. Other
    models' barriers still wait until after the pass."""
    scheduler = Scheduler(SchedulerLimits())
    for model in ("a", "b", "c", "d"):
        scheduler.open_model(ModelId(model), next_seq_id=1)
    for model in ("a", "b"):
        scheduler.submit(QueuedRequest(RequestId(f"{model}#1"), TenantId(model), ModelId(model),
                                       RequestKind.FORWARD_BACKWARD, 1, 64))
    first = scheduler.step()
    (ran,) = first.passes
    for model in ("a", "b"):
        scheduler.submit(QueuedRequest(RequestId(f"{model}#2"), TenantId(model), ModelId(model),
                                       RequestKind.OPTIM_STEP, 2))
    scheduler.submit(QueuedRequest(RequestId("c#1"), TenantId("c"), ModelId("c"), RequestKind.FORWARD_BACKWARD,
                                   1, 64))
    scheduler.submit(QueuedRequest(RequestId("d#1"), TenantId("d"), ModelId("d"), RequestKind.OPTIM_STEP, 1))
    scheduler.complete(ran, [object(), object()])
    plan = scheduler.step()
    order = [r.request_id for item in plan.items for r in item.requests]
    assert sorted(order[:2]) == ["a#2", "b#2"]
    assert order[2:] == ["c#1", "d#1"]


def test_a_light_request_still_waits_for_a_heavy_request_that_is_running() -> None:
    """Requests are never split across passes: beside one 640-token request at a time, pacing bounds the
    light tenant's wait by that request (about 10x its own pass), not by everything the heavy one queued."""
    paced, _, _ = light_wait_ratio(SchedulerLimits(max_tokens_per_pass=32768, max_pass_seconds=pass_cost(64),
                                                   hold_factor=0), heavy_models=1, heavy_tokens=640)
    unpaced, _, _ = light_wait_ratio(UNPACED, heavy_models=1, heavy_tokens=640)
    assert 5 < paced < 12 < unpaced


def test_by_default_a_light_tenant_waits_about_a_paced_pass_then_its_own() -> None:
    """The default pace: a pass takes about `pass_latency_factor` times the light tenant's own pass, so its
    worst-case wait (arriving just after a pass started) is about twice that, not two whole heavy passes."""
    limits = SchedulerLimits(max_tokens_per_pass=32768)
    factor = limits.pass_latency_factor
    paced, paced_rate, sim = light_wait_ratio(limits, heavy_models=10, heavy_tokens=64)
    unpaced, unpaced_rate, _ = light_wait_ratio(UNPACED, heavy_models=10, heavy_tokens=64)
    assert paced <= 2 * factor * 1.05 < unpaced
    # The paced size, or room for the light tenant and one request its size where that is less.
    paced_tokens = factor * 64 + (factor - 1) * FIXED_S / PER_TOKEN_S
    assert max(sim.pass_tokens[-100:]) <= max(paced_tokens, RIDE_ALONG_REQUESTS * 64)
    assert paced_rate > 0.4 * unpaced_rate  # heavy keeps progressing


def test_by_default_a_tenant_alone_keeps_full_passes() -> None:
    sim = Sim(SchedulerLimits(max_tokens_per_pass=32768))
    for i in range(10):
        sim.add("heavy", f"h{i}", 64)
    sim.add("heavy", "h-big", 300)  # its own models differ in size: still one tenant, still full passes
    sim.run(40)
    assert set(sim.pass_tokens) == {940}


def test_by_default_an_engine_with_mostly_fixed_pass_cost_keeps_packing_every_tenant() -> None:
    """On a GPU a small pass costs nearly as much as a large one: pacing leaves passes holding all tenants."""
    sim = Sim(SchedulerLimits(max_tokens_per_pass=32768), gpu_pass_cost)
    for i in range(10):
        sim.add("heavy", f"h{i}", 64)
    sim.add("light", "l", 64)
    sim.add("tiny", "t", 13)
    sim.run(60)
    assert set(sim.pass_tokens[-20:]) == {11 * 64 + 13}


def test_the_smallest_contending_tenant_sets_the_pace() -> None:
    """A tenant with 8-token requests shrinks passes below what a 64-token one gets; a 64-token request
    still runs (alone) when it does not fit."""
    sim = Sim(SchedulerLimits(max_tokens_per_pass=32768, pass_latency_factor=3))
    for i in range(10):
        sim.add("heavy", f"h{i}", 64)
    sim.add("light", "l", 64)
    sim.run(60)
    assert max(sim.pass_tokens[-20:]) == 3 * 64  # 3 * 64 + 2 * fixed / per_token: three requests
    before = dict(sim.tokens)
    sim.add("tiny", "t", 8)
    sim.run(60)
    assert max(sim.pass_tokens[-20:]) == 64  # 3 * 8 + 13: a 64-token request only alone
    assert all(sim.tokens[t] > before[t] for t in ("heavy", "light"))  # the 64-token requests still run


def test_a_newcomer_goes_first_in_a_pass_that_fits_one_request() -> None:
    """Paced passes of about one request: the tenant that just became backlogged gets its turn's quantum first,
    instead of the busy tenant spending credit left from its last pass and taking the only slot."""
    packer = FairPacker(quantum_tokens=2048)
    limits = SchedulerLimits(max_tokens_per_pass=4096)

    def req(tenant: str, model: str, seq: int) -> QueuedRequest:
        return QueuedRequest(RequestId(f"{model}#{seq}"), TenantId(tenant), ModelId(model), RequestKind.FORWARD,
                             seq, 64)

    heavy = [[req("heavy", f"h{i}", 1)] for i in range(10)]
    one_adapter = SchedulerLimits(max_tokens_per_pass=4096, max_adapters_per_pass=1)
    first = packer.pack(heavy, one_adapter, token_budget=128)
    assert len(first) == 1 and packer.deficit(TenantId("heavy")) >= 64  # credit left for its next request
    heavy = [run for run in heavy if run[0] not in first]
    chosen = packer.pack([*heavy, [req("light", "l", 1)]], limits, token_budget=100)
    assert [r.tenant_id for r in chosen] == ["light"]
