"""SchedulerLoop over a recording fake backend: one backend call per packed pass (many tenants), ordered
barriers, failures confined to their item, markers and duplicates acked, results stored then announced."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from services.control.api import ModelCreated, OptimStepDone
from services.domain.backend import BaseModelInfo
from services.domain.sampling import SampledSequence, SampleResult, SampleWork
from services.domain.training import (
    AdamParams,
    AdapterId,
    Datum,
    DatumOutput,
    ForwardBackwardResult,
    ForwardBackwardWork,
    LoraSpec,
    OptimStepResult,
    WorkError,
)
from services.jobqueue import InMemoryNotifier, InMemoryResultStore, InMemoryWorkQueue, ResultStatus
from services.metrics.series import LOOP_CPU_PARTS, RuntimeMetrics
from services.runtime import CreateAdapter, ForwardBackward, LoopConfig, OptimStep, Sample, SchedulerLoop
from services.runtime.loop import TenantActivity
from services.runtime.reporting import CompletionHook, LoopCpu, StoreResults
from services.scheduler import QueuedRequest, RequestId, RequestKind
from services.scheduler.requests import Completion, ModelId, StepPlan, TenantId
from services.scheduler.scheduler import Scheduler

BASE = "fake"


class FakeBackend:
    """Records calls; `explode` names adapters whose passes raise."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.adapters: set[AdapterId] = set()
        self.explode: set[AdapterId] = set()

    @property
    def info(self) -> BaseModelInfo:
        return BaseModelInfo(BASE, "fake", 512, 128, "/nonexistent", (0,))

    def create_adapter(self, adapter_id: AdapterId, spec: LoraSpec) -> None:
        self.calls.append(("create", adapter_id))
        self.adapters.add(adapter_id)

    def drop_adapter(self, adapter_id: AdapterId) -> None:
        self.adapters.discard(adapter_id)

    def has_adapter(self, adapter_id: AdapterId) -> bool:
        return adapter_id in self.adapters

    def forward_backward(
        self, works: Sequence[ForwardBackwardWork]
    ) -> list[ForwardBackwardResult | WorkError]:
        self.calls.append(("pass", [w.adapter_id for w in works]))
        if any(w.adapter_id in self.explode for w in works):
            raise RuntimeError("device fell over")
        return [
            ForwardBackwardResult(
                [DatumOutput(np.zeros(d.length), np.zeros(d.length)) for d in w.data],
                {"loss:sum": float(w.num_tokens)},
            )
            for w in works
        ]

    def optim_step(self, adapter_id: AdapterId, params: AdamParams) -> OptimStepResult:
        self.calls.append(("optim", adapter_id))
        return OptimStepResult({"learning_rate:mean": params.learning_rate})

    def sample(self, works: Sequence[SampleWork]) -> list[SampleResult | WorkError]:
        self.calls.append(("sample", len(works)))
        return [SampleResult([SampledSequence([1, 2], [-0.1, -0.2], "length")]) for _ in works]

    def save_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> int:
        raise NotImplementedError

    def load_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> LoraSpec:
        raise NotImplementedError


class Rig:
    def __init__(self, hook: CompletionHook | None = None, unrecorded_retry_s: float = 5.0,
                 backend: FakeBackend | None = None, metrics: RuntimeMetrics | None = None) -> None:
        self.backend = backend or FakeBackend()
        self.queue, self.results, self.notifier = (
            InMemoryWorkQueue(),
            InMemoryResultStore(),
            InMemoryNotifier(),
        )
        self.loop = SchedulerLoop(
            BASE,
            self.backend,
            self.queue,
            self.results,
            self.notifier,
            config=LoopConfig(poll_s=0.02, batch_window_s=0.0, unrecorded_retry_s=unrecorded_retry_s),
            hook=hook,
            metrics=metrics,
        )
        self._n = 0

    def put(
        self,
        model: str,
        kind: RequestKind,
        seq: int | None,
        payload: object = None,
        tenant: str = "t",
        tokens: int = 0,
        request_id: str | None = None,
    ) -> RequestId:
        self._n += 1
        rid = RequestId(request_id or f"r{self._n}")
        self.queue.enqueue(
            BASE,
            QueuedRequest(
                rid, TenantId(tenant), ModelId(model), kind, seq, tokens, time.monotonic(), payload
            ),
        )
        return rid

    def result(self, rid: RequestId) -> object:
        stored = self.results.get_nowait(rid)
        assert stored is not None, f"no result for {rid}"
        return stored.value


def _fb(adapter: str, n: int = 4) -> ForwardBackward:
    seq = np.arange(n + 1)
    return ForwardBackward(
        ForwardBackwardWork(AdapterId(adapter), [Datum(seq[:-1], {"target_tokens": seq[1:]})])
    )


def test_one_backend_call_per_pass_for_many_tenants() -> None:
    rig = Rig()
    for i, tenant in enumerate(("a", "b", "c")):
        model = f"m{i}"
        rig.put(
            model,
            RequestKind.CREATE,
            0,
            CreateAdapter(ModelId(model), AdapterId(model), LoraSpec(rank=2)),
            tenant=tenant,
        )
    rig.loop.run_once()
    fbs = {
        f"m{i}": rig.put(f"m{i}", RequestKind.FORWARD_BACKWARD, 1, _fb(f"m{i}"), tenant=t, tokens=4)
        for i, t in enumerate(("a", "b", "c"))
    }
    rig.loop.run_once()
    passes = [args for kind, args in rig.backend.calls if kind == "pass"]
    assert passes == [[AdapterId("m0"), AdapterId("m1"), AdapterId("m2")]]
    for rid in fbs.values():
        assert isinstance(rig.result(rid), ForwardBackwardResult)
    stats = rig.loop.stats()
    assert stats.passes == 1 and stats.multi_tenant_passes == 1 and stats.tenants_per_pass_total == 3
    assert stats.barriers == 3 and rig.queue.unacked(BASE) == 0


def test_order_markers_duplicates_and_failures() -> None:
    rig = Rig()
    rig.put("m", RequestKind.CREATE, 0, CreateAdapter(ModelId("m"), AdapterId("m"), LoraSpec(rank=2)))
    opt = rig.put("m", RequestKind.OPTIM_STEP, 3, OptimStep(AdapterId("m"), AdamParams(learning_rate=0.5)))
    rig.put("m", RequestKind.CONSUMED, 2, request_id="rejected")  # seq 2 was refused at the edge
    fb = rig.put("m", RequestKind.FORWARD_BACKWARD, 1, _fb("m"), tokens=4)
    rig.put("m", RequestKind.FORWARD_BACKWARD, 1, _fb("m"), tokens=4, request_id="dup")  # a redelivery
    for _ in range(4):
        rig.loop.run_once()
    assert rig.result(RequestId("r1")) == ModelCreated(ModelId("m"))
    assert isinstance(rig.result(fb), ForwardBackwardResult)
    assert rig.result(opt) == OptimStepDone({"learning_rate:mean": 0.5})
    assert [kind for kind, _ in rig.backend.calls] == ["create", "pass", "optim"]
    assert (
        rig.results.get_nowait(RequestId("rejected")) is None
        and rig.results.get_nowait(RequestId("dup")) is None
    )
    assert rig.queue.unacked(BASE) == 0

    rig.backend.explode.add(AdapterId("m"))
    boom = rig.put("m", RequestKind.FORWARD_BACKWARD, 4, _fb("m"), tokens=4)
    after = rig.put("m", RequestKind.OPTIM_STEP, 5, OptimStep(AdapterId("m"), AdamParams()))
    sample = rig.put("s", RequestKind.SAMPLE, 0, Sample(SampleWork(None, np.array([1, 2]))))
    for _ in range(3):
        rig.loop.run_once()
    error = rig.result(boom)
    assert isinstance(error, WorkError) and error.category == "server" and "device fell over" in error.message
    assert isinstance(rig.result(after), OptimStepDone)  # the loop carried on
    assert isinstance(rig.result(sample), SampleResult)
    assert rig.results.get_nowait(boom).status is ResultStatus.ERROR  # type: ignore[union-attr]
    assert rig.loop.stats().requests_failed == 1


class FlakyHook:
    """A completion hook whose bookkeeping fails while `down` (a database outage its retries gave up on)."""

    def __init__(self) -> None:
        self.down = False
        self.recorded: list[list[RequestId]] = []

    def started(self, requests: Sequence[QueuedRequest], pass_id: str) -> None:
        pass

    def finished(self, completions: Sequence[Completion], pass_id: str | None,
                 store: StoreResults) -> list[Completion]:
        if self.down:
            raise RuntimeError("database unreachable")
        store(completions)
        self.recorded.append([c.request_id for c in completions])
        return list(completions)


def test_an_item_whose_bookkeeping_failed_keeps_its_queue_entries_until_it_is_written() -> None:
    hook = FlakyHook()
    rig = Rig(hook, unrecorded_retry_s=0.0)
    rig.put("m", RequestKind.CREATE, 0, CreateAdapter(ModelId("m"), AdapterId("m"), LoraSpec(rank=2)))
    rig.loop.run_once()
    hook.down = True
    fb = rig.put("m", RequestKind.FORWARD_BACKWARD, 1, _fb("m"), tokens=4)
    rig.loop.run_once()
    assert isinstance(rig.result(fb), ForwardBackwardResult)  # the client has its result
    assert rig.queue.unacked(BASE) == 1  # a successor would claim the entry again
    rig.loop.run_once()  # still down: the retry fails, the entry stays held
    assert rig.queue.unacked(BASE) == 1 and hook.recorded == [[RequestId("r1")]]

    hook.down = False
    opt = rig.put("m", RequestKind.OPTIM_STEP, 2, OptimStep(AdapterId("m"), AdamParams()))
    rig.loop.run_once()  # the held item is written first, then the new one
    assert hook.recorded == [[RequestId("r1")], [fb], [opt]]
    assert rig.queue.unacked(BASE) == 0
    assert [kind for kind, _ in rig.backend.calls] == ["create", "pass", "optim"]  # nothing ran twice


class CpuClock:
    """A stand-in for the loop thread's CPU clock, which the fakes below advance by what each part 'costs'."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostlyBackend(FakeBackend):
    """Each backend call takes CPU: a pass 5 s, a sample batch 3 s, a barrier (create, optim_step) 0.5 s."""

    def __init__(self, clock: CpuClock) -> None:
        super().__init__()
        self.clock = clock

    def create_adapter(self, adapter_id: AdapterId, spec: LoraSpec) -> None:
        self.clock.now += 0.5
        super().create_adapter(adapter_id, spec)

    def forward_backward(self, works: Sequence[ForwardBackwardWork]) -> list[ForwardBackwardResult | WorkError]:
        self.clock.now += 5.0
        return super().forward_backward(works)

    def optim_step(self, adapter_id: AdapterId, params: AdamParams) -> OptimStepResult:
        self.clock.now += 0.5
        return super().optim_step(adapter_id, params)

    def sample(self, works: Sequence[SampleWork]) -> list[SampleResult | WorkError]:
        self.clock.now += 3.0
        return super().sample(works)


class CostlyHook(FlakyHook):
    """Bookkeeping takes CPU too: 0.125 s when an item starts, 0.25 s when it is recorded."""

    def __init__(self, clock: CpuClock) -> None:
        super().__init__()
        self.clock = clock

    def started(self, requests: Sequence[QueuedRequest], pass_id: str) -> None:
        self.clock.now += 0.125

    def finished(self, completions: Sequence[Completion], pass_id: str | None,
                 store: StoreResults) -> list[Completion]:
        self.clock.now += 0.25
        return super().finished(completions, pass_id, store)


def test_the_loop_threads_cpu_is_billed_to_the_backends_calls_and_to_the_work_around_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = CpuClock()
    monkeypatch.setattr(LoopCpu, "clock", clock)
    registry = CollectorRegistry()
    metrics = RuntimeMetrics(registry)
    rig = Rig(CostlyHook(clock), backend=CostlyBackend(clock), metrics=metrics)
    for tenant in ("a", "b"):
        rig.put(tenant, RequestKind.CREATE, 0, CreateAdapter(ModelId(tenant), AdapterId(tenant), LoraSpec(rank=2)),
                tenant=tenant)
    rig.loop.run_once()
    for tenant in ("a", "b"):  # two tenants' requests: one pass, then each tenant's own optim_step
        rig.put(tenant, RequestKind.FORWARD_BACKWARD, 1, _fb(tenant), tenant=tenant, tokens=4)
        rig.put(tenant, RequestKind.OPTIM_STEP, 2, OptimStep(AdapterId(tenant), AdamParams()), tenant=tenant)
    rig.put("s", RequestKind.SAMPLE, 0, Sample(SampleWork(None, np.array([1, 2]))))
    rig.loop.run_once()
    rig.loop.run_once()

    def billed(part: str) -> float | None:
        return registry.get_sample_value("carpool_scheduler_loop_cpu_seconds_total",
                                         {"base_model": BASE, "part": part})

    kinds = [kind for kind, _ in rig.backend.calls]
    assert sorted(kinds) == ["create", "create", "optim", "optim", "pass", "sample"]
    items = len(kinds)  # one backend call per plan item: the pass ran both tenants' requests
    assert billed("pass") == 5.0 and billed("sample_batch") == 3.0
    assert billed("barrier") == 4 * 0.5  # two creates, two optim_steps
    assert billed("bookkeeping") == items * (0.125 + 0.25)
    assert billed("planning") == 0.0  # nothing above advanced the clock while the loop planned
    assert sum(billed(part) or 0.0 for part in LOOP_CPU_PARTS) == clock.now


def test_threaded_loop_wakes_waiters_and_stops_gracefully() -> None:
    rig = Rig()
    rig.loop.start()
    try:
        assert rig.loop.running

        async def submit_and_wait() -> bool:
            rid = rig.put("m", RequestKind.CREATE, 0, CreateAdapter(ModelId("m"), AdapterId("m"), LoraSpec()))
            return await rig.notifier.wait(rid, 10.0)

        assert asyncio.run(submit_and_wait())
    finally:
        rig.loop.stop(timeout_s=5.0)
    assert not rig.loop.running and not rig.loop.stats().running


def test_a_payload_that_is_not_a_command_fails_only_its_request() -> None:
    rig = Rig()
    bad = rig.put("m", RequestKind.CREATE, 0, payload={"not": "a command"})
    rig.loop.run_once()
    error = rig.result(bad)
    assert isinstance(error, WorkError) and error.category == "server"
    ok = rig.put("n", RequestKind.CREATE, 0, CreateAdapter(ModelId("n"), AdapterId("n"), LoraSpec()))
    rig.loop.run_once()
    assert rig.result(ok) == ModelCreated(ModelId("n"))


@pytest.mark.parametrize("window", [0.0, 0.05])
def test_batch_window_collects_late_arrivals(window: float) -> None:
    rig = Rig()
    rig.loop = SchedulerLoop(
        BASE, rig.backend, rig.queue, rig.results, rig.notifier, config=LoopConfig(batch_window_s=window)
    )
    for m in ("a", "b"):
        rig.put(m, RequestKind.CREATE, 0, CreateAdapter(ModelId(m), AdapterId(m), LoraSpec()), tenant=m)
    rig.loop.run_once()
    rig.put("a", RequestKind.FORWARD_BACKWARD, 1, _fb("a"), tenant="a", tokens=4)
    rig.loop.start()
    time.sleep(0.01)
    rig.put("b", RequestKind.FORWARD_BACKWARD, 1, _fb("b"), tenant="b", tokens=4)
    deadline = time.monotonic() + 5
    while rig.loop.stats().requests_completed < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    rig.loop.stop()
    passes = [args for kind, args in rig.backend.calls if kind == "pass"]
    if window:
        assert passes == [[AdapterId("a"), AdapterId("b")]]
    else:
        assert sum(len(p) for p in passes) == 2


def _window_rig(monkeypatch: pytest.MonkeyPatch, *, lookback_s: float | None = 1.0,
                scheduler: Scheduler | None = None) -> tuple[Rig, list[float]]:
    """A rig with a batch window whose waits are recorded instead of slept."""
    rig = Rig()
    rig.loop = SchedulerLoop(BASE, rig.backend, rig.queue, rig.results, rig.notifier, scheduler=scheduler,
                             config=LoopConfig(batch_window_s=0.05, batch_window_lookback_s=lookback_s))
    waits: list[float] = []
    monkeypatch.setattr("services.runtime.loop.time.sleep", waits.append)
    return rig, waits


def _create(rig: Rig, *tenants: str) -> None:
    for t in tenants:
        rig.put(t, RequestKind.CREATE, 0, CreateAdapter(ModelId(t), AdapterId(t), LoraSpec()), tenant=t)


def test_a_lone_tenant_is_not_held_by_the_batch_window(monkeypatch: pytest.MonkeyPatch) -> None:
    rig, waits = _window_rig(monkeypatch)
    _create(rig, "a")
    rig.loop.run_once()
    fb = rig.put("a", RequestKind.FORWARD_BACKWARD, 1, _fb("a"), tenant="a", tokens=4)
    rig.loop.run_once()
    assert waits == [] and isinstance(rig.result(fb), ForwardBackwardResult)


def test_the_batch_window_applies_while_another_tenant_is_active(monkeypatch: pytest.MonkeyPatch) -> None:
    rig, waits = _window_rig(monkeypatch, lookback_s=3600.0)  # a lookback no slow machine can outlast
    _create(rig, "a")
    rig.loop.run_once()
    _create(rig, "b")
    rig.loop.run_once()  # a barrier: nothing to wait for, but b is now active too
    rig.put("a", RequestKind.FORWARD_BACKWARD, 1, _fb("a"), tenant="a", tokens=4)
    rig.loop.run_once()  # a pass while b was active within the lookback: wait for company
    rig.put("b", RequestKind.FORWARD_BACKWARD, 1, _fb("b"), tenant="b", tokens=4)
    rig.loop.run_once()
    assert waits == [0.05, 0.05]


def test_barriers_alone_are_not_held_by_the_batch_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """An optimizer step (or any barrier) runs alone for its model: waiting for company gains nothing."""
    rig, waits = _window_rig(monkeypatch, lookback_s=3600.0)
    _create(rig, "a", "b")
    rig.loop.run_once()  # two tenants' creates: barriers only
    rig.put("a", RequestKind.FORWARD_BACKWARD, 1, _fb("a"), tenant="a", tokens=4)
    rig.loop.run_once()
    step = rig.put("a", RequestKind.OPTIM_STEP, 2, OptimStep(AdapterId("a"), AdamParams()), tenant="a")
    rig.loop.run_once()
    assert waits == [0.05] and isinstance(rig.result(step), OptimStepDone)


class _Holding(Scheduler):
    """Holds every step for `hold_s`, as the real scheduler does while it expects another tenant back."""

    def __init__(self, hold_s: float) -> None:
        super().__init__()
        self.hold_s = hold_s

    def step(self) -> StepPlan:
        return dataclasses.replace(super().step(), hold_s=self.hold_s)


@pytest.mark.parametrize(("hold_s", "expected"), [(3600.0, []), (0.0, [0.05])])
def test_a_held_step_is_not_held_again_by_the_batch_window(monkeypatch: pytest.MonkeyPatch, hold_s: float,
                                                           expected: list[float]) -> None:
    """While the scheduler holds for predicted arrivals, each one is planned at once: the window would only
    delay the pass that the last of them completes. A hold that has run out no longer counts."""
    rig, waits = _window_rig(monkeypatch, lookback_s=3600.0, scheduler=_Holding(hold_s))
    _create(rig, "a", "b")
    rig.loop.run_once()  # barriers: no window; the step's plan holds from now on
    rig.put("a", RequestKind.FORWARD_BACKWARD, 1, _fb("a"), tenant="a", tokens=4)
    rig.loop.run_once()
    assert waits == expected


def test_the_batch_window_always_applies_without_a_lookback(monkeypatch: pytest.MonkeyPatch) -> None:
    rig, waits = _window_rig(monkeypatch, lookback_s=None)
    _create(rig, "a")
    rig.loop.run_once()
    rig.put("a", RequestKind.FORWARD_BACKWARD, 1, _fb("a"), tenant="a", tokens=4)
    rig.loop.run_once()
    assert waits == [0.05]


def test_tenant_activity_counts_tenants_within_the_lookback() -> None:
    activity = TenantActivity(lookback_s=1.0)
    assert activity.note(["a"], now=10.0) == 1
    assert activity.note(["a"], now=10.5) == 1
    assert activity.note(["b"], now=10.9) == 2
    assert activity.note([], now=11.6) == 1  # a was last seen at 10.5
    assert activity.note(["c", "c"], now=13.0) == 1  # b expired too; c counts once

