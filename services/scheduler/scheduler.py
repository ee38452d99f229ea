"""`Scheduler`: the per-base-model decision loop, pure (no threads, no I/O, injectable clock).

    submit()  ──▶ per-model Sequencer (seq_id order, dedupe, consumed gaps) ──▶ per-model ready queues
    step():   take in-order requests ─▶ barriers of idle models ─▶ packed pass(es) under the budgets,
              fair across tenants ─▶ sample batches ─▶ StepPlan (+ requests rejected on admission)
    complete(item, results) ──▶ models unblocked; results paired with their requests

Rules that keep per-model semantics while models share passes:
- a model's pass-kind requests (forward / forward_backward) up to its next barrier may join passes, even
  while earlier passes of that model are in flight (they commute: weights change only at barriers);
- a barrier (optim_step / save / load / create) is dispatched only when nothing of its model is in
  flight, and while it is, nothing else of that model is planned; it never blocks other models.

Passes are timed from dispatch (or the previous item's completion, as the loop runs items one by one) to
`complete()`, which feeds the pass cost model behind `PassPacer`. Pacing applies only under contention
(pass work of two or more tenants within `CONTENTION_WINDOW_S`): a tenant training alone keeps full passes.
The pace is set by the smallest contending tenant: its queued pass work (remembered while it waits for its
next request) is what it would run alone, and `SchedulerLimits.pass_latency_factor` times that pass's
estimated duration is the target (or `max_pass_seconds`, when set); the budget never falls below one
round of every queued tenant sending up to the smallest one's work, because equal tenants split over several
passes each wait longer, not less.

Independent closed-loop clients would never arrive together, so a pass (and a sample batch) may be held
for active tenants predicted to arrive soon (`services/scheduler/arrivals.py`): never for a lone tenant,
never while a full pass (tokens or adapters) is queued, at most `hold_factor` times the item's fixed cost
(`max_hold_seconds` at most). Beside a heavy backlog a paced pass always has room for the light tenant and
one more request its size, so the two ride together rather than take turns, and it waits for a light tenant
due back at most `HEAVY_HOLD_SHARE` of that pass. A held step returns
`StepPlan.hold_s`, how long the loop may wait for new submissions before stepping again. A step's barriers
of the models in the pass that completed last run before its passes (`StepPlan.items`), the others after.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence

from services.domain.training import WorkError
from services.scheduler.arrivals import PASS, SAMPLE, ArrivalForecast, Holds
from services.scheduler.backlog import Outstanding, PassWork, queued_tokens
from services.scheduler.ordering import DEFAULT_DEDUPE_WINDOW, Sequencer, StaleSeqIdError
from services.scheduler.pacing import PassPacer
from services.scheduler.policy import FairPacker, SampleQueues, SchedulerLimits
from services.scheduler.requests import (
    Admission,
    BarrierPlan,
    Completion,
    ModelId,
    PassPlan,
    PassSegment,
    PlanItem,
    PlanItemId,
    QueuedRequest,
    RequestId,
    RequestKind,
    SampleBatchPlan,
    SchedulerStats,
    StepPlan,
    TenantId,
    error_completion,
    models_held,
    pair_results,
)

HEAVY_HOLD_SHARE = 0.5
"""Beside a heavy backlog, a pass waits for a light tenant due back for at most this share of its estimated
duration (the heavy tenant's price, per light step, for the light tenant not waiting a whole pass out). Half
a pass covers an SDK client's turnaround (10-15 ms over HTTP) beside the ~30-40 ms passes of a CPU; a quarter
did not, and the light tenant then waited out a pass on every step (simulated: 2.4x its wait alone instead of
1.4x, docs/performance.md "Fairness")."""

RIDE_ALONG_REQUESTS = 2
"""Beside a heavy backlog, a paced pass has room for at least this many requests of the light tenant's size:
the light one and one more. With room for one only, the two would take turns, and the light tenant would wait
a whole heavy pass on every step (about 2x its own pass); riding along costs it only the extra tokens."""

CONTENTION_WINDOW_S = 5.0
"""How recently another tenant must have had pass work for passes to be paced (a training loop's requests
come back within a few passes; an idle tenant should not cost the busy one its packing)."""


class Scheduler:
    """Orders, packs and fairly shares one base model's work; see the module docstring for the flow.

    Not thread-safe by design: one service loop owns it (claim → submit → step → dispatch → complete).
    """

    def __init__(
        self,
        limits: SchedulerLimits | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        tenant_weights: Mapping[TenantId, float] | None = None,
        dedupe_window: int = DEFAULT_DEDUPE_WINDOW,
    ) -> None:
        self.limits = limits or SchedulerLimits()
        self._clock = clock
        self._sequencer = Sequencer(dedupe_window)
        self._packer = FairPacker(self.limits.quantum_tokens, tenant_weights)
        self._pacer = PassPacer(self.limits.max_pass_seconds, self.limits.pass_latency_factor)
        self._planned_at: dict[PlanItemId, float] = {}
        self._pass_work = PassWork(CONTENTION_WINDOW_S)
        self._outstanding = Outstanding()
        self._last_completed_at = float("-inf")
        self._holds = Holds(self.limits.hold_factor, self.limits.max_hold_seconds,
                            ArrivalForecast(CONTENTION_WINDOW_S))
        self._ready: dict[ModelId, deque[QueuedRequest]] = {}
        self._samples = SampleQueues()
        self._rejected: list[Completion] = []
        self._in_flight: dict[PlanItemId, PlanItem] = {}
        self._busy: dict[ModelId, int] = {}
        self._barrier_busy: set[ModelId] = set()
        self._last_pass_models: frozenset[ModelId] = frozenset()
        """The models of the pass that completed last (their adapters are likely still on the device)."""
        self._item_ids = itertools.count(1)
        self._totals: dict[str, int] = dict.fromkeys(
            ("passes", "barriers", "sample_batches", "rejected", "tokens", "tenants", "last_tenants", "holds"), 0
        )

    # ---- intake -------------------------------------------------------------------------------------

    def open_model(self, model_id: ModelId, next_seq_id: int = 0) -> None:
        """Declare a model's position; only needed when it does not start at seq 0 (e.g. after recovery)."""
        self._sequencer.open(model_id, next_seq_id)

    def submit(self, request: QueuedRequest) -> Admission:
        """Admit one request. Never raises for a bad request: its error comes out in `StepPlan.rejected`."""
        problem = request.problem()
        if problem is not None:
            return self._reject(request, problem)
        if request.kind is RequestKind.CONSUMED:
            return self._admit_consumed(request)
        admission = self._admit_sample(request) if request.kind is RequestKind.SAMPLE else self._admit_ordered(request)
        if admission.is_new:
            now = self._clock()
            # When it reached the gateway, if that is on this clock: the loop claims it only after the item
            # running then, and the client's turnaround must not include that.
            arrived = request.enqueued_at if 0 <= now - request.enqueued_at <= CONTENTION_WINDOW_S else now
            self._holds.forecast.arrived(request.tenant_id, request.kind, arrived)
        return admission

    def mark_consumed(self, model_id: ModelId, seq_id: int, request_id: RequestId | None = None) -> None:
        """The gateway rejected this seq_id at the edge: skip it so later requests of the model can run."""
        self._sequencer.mark_consumed(model_id, seq_id, request_id)

    def set_tenant_weight(self, tenant_id: TenantId, weight: float) -> None:
        self._packer.set_weight(tenant_id, weight)

    def close_model(self, model_id: ModelId) -> list[Completion]:
        """Forget a model; its queued requests fail (in-flight items still complete normally)."""
        dropped = [*self._ready.pop(model_id, ()), *self._sequencer.forget(model_id)]
        self._outstanding.remove(r.tenant_id for r in dropped)
        return [error_completion(r, f"model {model_id} was closed", "user") for r in dropped]

    # ---- the loop -----------------------------------------------------------------------------------

    def step(self) -> StepPlan:
        """Plan what to dispatch now. Every returned item must later go through `complete()`."""
        self._take_in_order()
        self._holds.forecast.forget_idle(self._clock())
        barriers = self._plan_barriers()
        passes, pass_hold = self._plan_passes()
        sample_batches, sample_hold = self._plan_sample_batches()
        rejected, self._rejected = tuple(self._rejected), []
        self._drop_empty_queues()
        holds = [h for h in (pass_hold, sample_hold) if h is not None]
        return StepPlan(barriers=barriers, passes=passes, sample_batches=sample_batches, rejected=rejected,
                        hold_s=min(holds) if holds else None, warm_models=self._last_pass_models)

    def complete(self, item: PlanItem, results: Sequence[object] | WorkError) -> list[Completion]:
        """Record that `item` ran; pair its requests with `results`.

        `results` align with `item.requests` (a `PassPlan`'s in segment order), or are one `WorkError`
        for the whole item (the backend call failed). Missing results become server errors. Completing an
        item twice, or one this scheduler did not plan, returns [] and changes nothing.
        """
        if self._in_flight.get(item.item_id) is not item:
            return []
        del self._in_flight[item.item_id]
        self._outstanding.remove(r.tenant_id for r in item.requests)
        self._time_item(item)
        for model_id in models_held(item):
            self._busy[model_id] -= 1
            if not self._busy[model_id]:
                del self._busy[model_id]
        if isinstance(item, BarrierPlan):
            self._barrier_busy.discard(item.request.model_id)
        elif isinstance(item, PassPlan):
            self._last_pass_models = frozenset(models_held(item))
        self._note_completed(item)
        return pair_results(item.requests, results)

    def has_queued(self) -> bool:
        """Whether in-order requests wait (runnable now or once in-flight items complete) or rejections do.

        Early arrivals waiting for a missing seq_id are not counted: only a new submission can free them.
        """
        self._take_in_order()
        return any(self._ready.values()) or bool(self._samples) or bool(self._rejected)

    def stats(self) -> SchedulerStats:
        self._take_in_order()  # count released requests where they will be planned from; no decision made
        waiting = list(self._sequencer.waiting())
        queued = [*itertools.chain.from_iterable(self._ready.values()), *waiting, *self._samples]
        oldest = min((r.enqueued_at for r in queued), default=None)
        totals = self._totals
        return SchedulerStats(
            queued_by_model=dict(Counter(r.model_id for r in queued if r.kind.is_ordered)),
            queued_by_tenant=dict(Counter(r.tenant_id for r in queued)),
            out_of_order_waiting=len(waiting),
            samples_queued=len(self._samples),
            in_flight_items=len(self._in_flight),
            oldest_wait_s=0.0 if oldest is None else max(0.0, self._clock() - oldest),
            passes_planned=totals["passes"],
            barriers_planned=totals["barriers"],
            sample_batches_planned=totals["sample_batches"],
            requests_rejected=totals["rejected"],
            tokens_planned=totals["tokens"],
            tenants_in_last_pass=totals["last_tenants"],
            tenants_per_pass_total=totals["tenants"],
            holds=totals["holds"],
        )

    # ---- admission ----------------------------------------------------------------------------------

    def _admit_ordered(self, request: QueuedRequest) -> Admission:
        assert request.seq_id is not None
        known = self._sequencer.known(request.model_id, request.seq_id)
        if known is not None:
            return Admission(known, is_new=False)
        oversized = self._oversized(request)
        if oversized is not None:
            # It can never run; consuming its seq_id keeps the rest of the model flowing.
            self._sequencer.mark_consumed(request.model_id, request.seq_id, request.request_id)
            return self._reject(request, oversized)
        try:
            request_id, is_new = self._sequencer.submit(request)
        except StaleSeqIdError as exc:
            return self._reject(request, str(exc))
        if is_new:
            self._outstanding.add(request.tenant_id)
        return Admission(request_id, is_new)

    def _admit_consumed(self, request: QueuedRequest) -> Admission:
        """A seq_id rejected at the edge: skip it; later duplicates map to the marker's request id."""
        assert request.seq_id is not None
        known = self._sequencer.known(request.model_id, request.seq_id)
        changed = self._sequencer.mark_consumed(request.model_id, request.seq_id, request.request_id)
        return Admission(known or request.request_id, is_new=changed)

    def _admit_sample(self, request: QueuedRequest) -> Admission:
        request_id, is_new = self._samples.admit(request)
        if is_new:
            self._outstanding.add(request.tenant_id)
        return Admission(request_id, is_new)

    def _oversized(self, request: QueuedRequest) -> str | None:
        budget = self.limits.max_tokens_per_pass
        if request.kind.is_pass and request.num_tokens > budget:
            return (
                f"{request.kind.value} request has {request.num_tokens} tokens, more than the "
                f"{budget} tokens one pass can hold; split it into smaller batches"
            )
        return None

    def _reject(self, request: QueuedRequest, message: str) -> Admission:
        self._rejected.append(error_completion(request, message, "user"))
        self._totals["rejected"] += 1
        return Admission(request.request_id, is_new=True)

    # ---- planning -----------------------------------------------------------------------------------

    def _take_in_order(self) -> None:
        for request in self._sequencer.drain():
            self._ready.setdefault(request.model_id, deque()).append(request)

    def _plan_barriers(self) -> tuple[BarrierPlan, ...]:
        barriers: list[BarrierPlan] = []
        for model_id, queue in self._ready.items():
            if queue and queue[0].kind.is_barrier and model_id not in self._busy:
                barrier = BarrierPlan(self._new_item_id(), queue.popleft())
                self._track(barrier)
                barriers.append(barrier)
        return tuple(barriers)

    def _plan_passes(self) -> tuple[tuple[PassPlan, ...], float | None]:
        passes: list[PassPlan] = []
        for i in range(self.limits.max_passes_per_step):
            runs = [run for run in self._pass_runs() if run]
            if i == 0 and self._pacer.enabled:  # what each tenant has queued, before this step takes any
                self._pass_work.note(queued_tokens(runs), self._clock())
            budget = self._pass_budget(runs)
            if i == 0:
                # Room is judged against the hard limit (the paced budget grows by one share per arrival)
                # and the adapters a pass may hold: with a full pass queued, nobody could join it.
                queued = sum(r.num_tokens for run in runs for r in run)
                has_room = queued < self.limits.max_tokens_per_pass and len(runs) < self.limits.max_adapters_per_pass
                # The cap scans every contending tenant: only worth it when a hold is possible at all.
                cap = self._heavy_hold_cap(budget) if has_room else None
                hold = self._hold(PASS, {run[0].tenant_id for run in runs}, has_room, cap)
                if hold is not None:
                    return (), hold
            chosen = self._packer.pack(runs, self.limits, budget) if runs else []
            if not chosen:
                break
            plan = PassPlan(self._new_item_id(), self._take_segments(chosen))
            self._track(plan)
            passes.append(plan)
        return tuple(passes), None

    def _pass_budget(self, runs: list[list[QueuedRequest]]) -> int:
        """While tenants contend: the paced budget, set by the smallest one's work, but at least one pass for
        every queued tenant of about that size (within the latency factor). Pacing bounds a light tenant's
        wait beside a heavy backlog; equal tenants split over several passes would each wait longer, not
        less, and pay a pass's fixed cost each. Beside a heavy backlog, room for the light tenant to ride
        along with one more request (`RIDE_ALONG_REQUESTS`). Else the hard limit."""
        hard = self.limits.max_tokens_per_pass
        alike = self._pass_work.alike_tokens(self.limits.pass_latency_factor)
        if alike is None:
            return hard
        smallest = self._pass_work.smallest()
        floor = sum(tokens for tokens in queued_tokens(runs).values() if tokens <= alike)
        # Checked second: the scan of every contending tenant is only worth it when the floor would rise.
        if RIDE_ALONG_REQUESTS * smallest > floor and self._pass_work.any_above(alike):
            floor = RIDE_ALONG_REQUESTS * smallest
        return max(self._pacer.budget(hard, smallest), min(hard, floor))

    def _heavy_hold_cap(self, budget: int) -> float | None:
        """Beside a heavy backlog (a tenant with more queued than pacing lets into one pass), the longest a
        pass may wait for a light tenant due back: a share of the paced pass it would otherwise miss. A
        closed-loop light tenant comes back just after the pass planned at its barrier started, and would
        wait that whole pass out before riding in the next; holding a few ms costs the heavy tenant that
        share of one pass per light step instead. None: no heavy backlog (the usual hold rules)."""
        alike = self._pass_work.alike_tokens(self.limits.pass_latency_factor)
        if alike is None or not self._pass_work.any_above(alike):
            return None
        estimate = self._pacer.model.estimate(budget)
        return 0.0 if estimate is None else HEAVY_HOLD_SHARE * estimate

    def _hold(self, lane: str, ready: set[TenantId], has_room: bool, cap_s: float | None = None) -> float | None:
        """Seconds to hold `lane`'s next item for expected tenants, or None to dispatch it now."""
        if not ready or not has_room or cap_s == 0.0:
            return self._holds.release(lane)
        pending = {q[0].tenant_id for q in self._ready.values() if q and q[0].kind.is_barrier}
        pending |= {i.request.tenant_id for i in self._in_flight.values() if isinstance(i, BarrierPlan)}
        fit = self._pacer.model.cost()
        hold_s = self._holds.decide(lane, self._clock(), ready, pending, None if fit is None else fit[0], cap_s)
        self._totals["holds"] += hold_s is not None
        return hold_s

    def _pass_runs(self) -> Iterator[list[QueuedRequest]]:
        """Per schedulable model, its consecutive pass-kind requests up to the next barrier."""
        for model_id, queue in self._ready.items():
            if model_id not in self._barrier_busy:
                yield list(itertools.takewhile(lambda r: r.kind.is_pass, queue))

    def _take_segments(self, chosen: list[QueuedRequest]) -> tuple[PassSegment, ...]:
        """Pop the chosen requests (a prefix of each model's queue), grouped contiguously by model."""
        by_model: dict[ModelId, list[QueuedRequest]] = {}
        for request in chosen:
            by_model.setdefault(request.model_id, []).append(request)
        segments = []
        for model_id, requests in by_model.items():
            queue = self._ready[model_id]
            for request in requests:
                popped = queue.popleft()
                assert popped is request, "the packer takes each model's requests in queue order"
            segments.append(PassSegment(model_id, requests[0].tenant_id, tuple(requests)))
        return tuple(segments)

    def _plan_sample_batches(self) -> tuple[tuple[SampleBatchPlan, ...], float | None]:
        hold = self._hold(SAMPLE, self._samples.tenants(), len(self._samples) < self.limits.max_sample_batch)
        if hold is not None:
            return (), hold
        batches: list[SampleBatchPlan] = []
        for _ in range(self.limits.max_sample_batches_per_step):
            chosen = self._samples.take(self.limits.max_sample_batch)
            if not chosen:
                break
            batch = SampleBatchPlan(self._new_item_id(), tuple(chosen))
            self._track(batch)
            batches.append(batch)
        return tuple(batches), None

    def _drop_empty_queues(self) -> None:
        """Idle models and tenants should cost nothing per step."""
        self._ready = {m: q for m, q in self._ready.items() if q}

    def _time_item(self, item: PlanItem) -> None:
        """Feed a finished pass's duration to the pacer (items of one step run one after another), and
        every pass's and sample batch's to its lane's usual duration."""
        now = self._clock()
        planned_at = self._planned_at.pop(item.item_id, now)
        seconds = now - max(planned_at, self._last_completed_at)
        if isinstance(item, PassPlan):
            self._pacer.observe(item.num_tokens, seconds)
        if not isinstance(item, BarrierPlan):
            self._holds.observe(PASS if isinstance(item, PassPlan) else SAMPLE, seconds)
        self._last_completed_at = now

    def _note_completed(self, item: PlanItem) -> None:
        """Tell the forecast whose requests completed, and which of those tenants now wait on their client
        (nothing of theirs left queued, early or in flight: counted as it comes and goes, not scanned)."""
        now = self._clock()
        for request in item.requests:
            self._holds.forecast.completed(request.tenant_id, request.kind, now,
                                           idle=not self._outstanding.has(request.tenant_id))

    def _new_item_id(self) -> PlanItemId:
        return PlanItemId(next(self._item_ids))

    def _track(self, item: PlanItem) -> None:
        """Mark an item in flight right away, so later phases of the same step see its models busy."""
        self._in_flight[item.item_id] = item
        self._planned_at[item.item_id] = self._clock()
        for model_id in models_held(item):
            self._busy[model_id] = self._busy.get(model_id, 0) + 1
        if isinstance(item, BarrierPlan):
            self._barrier_busy.add(item.request.model_id)
            self._totals["barriers"] += 1
        elif isinstance(item, PassPlan):
            self._count_pass(item)
        else:
            self._totals["sample_batches"] += 1

    def _count_pass(self, plan: PassPlan) -> None:
        self._totals["passes"] += 1
        self._totals["tokens"] += plan.num_tokens
        self._totals["tenants"] += len(plan.tenants)
        self._totals["last_tenants"] = len(plan.tenants)
