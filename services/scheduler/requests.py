"""The scheduler's vocabulary: what is queued, what a step plans, what comes back, and its stats.

The scheduler owns *when* a request runs, never *what* it computes: a `QueuedRequest` carries only what
ordering, packing and fairness need (model, tenant, kind, seq_id, token count, enqueue time) plus an
opaque `payload` (the domain work object, e.g. `ForwardBackwardWork`) that is passed through untouched
to the dispatcher.

A `StepPlan`'s items are independent of each other: a model appears in at most one of them per step,
except that a model's pass-kind requests may span several passes (forward and forward_backward of one
model commute between barriers: weights only change at `optim_step`/`load`). So the dispatcher may run
the items of a step in any order or concurrently; running `passes` in list order keeps results
bit-stable. Every item must come back through `Scheduler.complete(item, results)` exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, NamedTuple, NewType

from services.domain.training import WorkError

RequestId = NewType("RequestId", str)
PlanItemId = NewType("PlanItemId", int)
TenantId = NewType("TenantId", str)
ModelId = NewType("ModelId", str)
"""A training model id (one adapter), or a sampling session id for `SAMPLE` requests."""


class RequestKind(StrEnum):
    """The kinds the scheduler distinguishes; variants of one kind (e.g. the three saves) live in payload."""

    FORWARD = "forward"
    """forward_only pass: logprobs and loss, no gradient."""
    FORWARD_BACKWARD = "forward_backward"
    """Packed pass that accumulates this adapter's gradient."""
    OPTIM_STEP = "optim_step"
    SAVE = "save"
    """save_state, save_weights_for_sampler (named or ephemeral), save_weights_external."""
    LOAD = "load"
    """load_weights / load_state, or create-from-checkpoint at seq 0."""
    CREATE = "create"
    """create_model: seq 0 of its model."""
    SAMPLE = "sample"
    """asample: unordered, batched across sampling sessions."""
    CONSUMED = "consumed"
    """Marker, not work: the gateway rejected this seq_id at the edge, so it must not block the model.
    Travels through the queue like a request (so the scheduler learns of it) and produces no result."""

    @property
    def is_pass(self) -> bool:
        """Packable into a shared forward(/backward) pass with other models' requests."""
        return self in (RequestKind.FORWARD, RequestKind.FORWARD_BACKWARD)

    @property
    def packs(self) -> bool:
        """Shares its item with other tenants' requests: a pass, or a sample batch."""
        return self.is_pass or self is RequestKind.SAMPLE

    @property
    def is_barrier(self) -> bool:
        """Runs alone for its model, after every earlier request of that model has run."""
        return self in (RequestKind.OPTIM_STEP, RequestKind.SAVE, RequestKind.LOAD, RequestKind.CREATE)

    @property
    def is_ordered(self) -> bool:
        """Executed in seq_id order per model (everything but sampling)."""
        return self is not RequestKind.SAMPLE


@dataclass(frozen=True, eq=False)
class QueuedRequest:
    """One submitted request as the scheduler sees it. Identity (`eq=False`) is the object itself."""

    request_id: RequestId
    tenant_id: TenantId
    model_id: ModelId
    kind: RequestKind
    seq_id: int | None
    """Required for ordered kinds (0 = create/load, first training request is 1); optional for samples,
    where it only serves dedupe of `(sampling_session_id, seq_id)`."""
    num_tokens: int = 0
    """Tokens this request puts into a pass (sum of its datums' lengths); what budgets and fairness count."""
    enqueued_at: float = 0.0
    """Clock reading at submission (same clock as the scheduler's); for wait-time stats and tie-breaks."""
    payload: object = field(default=None, repr=False)
    """The domain work object; never inspected by the scheduler."""

    def problem(self) -> str | None:
        """Why this request can never be scheduled, or None. Checked once, at admission."""
        if self.kind.is_ordered and self.seq_id is None:
            return f"{self.kind.value} request {self.request_id} has no seq_id"
        if self.seq_id is not None and self.seq_id < 0:
            return f"seq_id must be >= 0, got {self.seq_id}"
        if self.num_tokens < 0:
            return f"num_tokens must be >= 0, got {self.num_tokens}"
        return None


class Admission(NamedTuple):
    """Answer to a submission: the request id to hand the client and whether this was a new request.

    A duplicate `(model_id, seq_id)` answers with the id of the request already known (`is_new=False`),
    so retries map onto the same future. A request refused at admission is still `is_new=True`; its
    error result comes out in the next `StepPlan.rejected`.
    """

    request_id: RequestId
    is_new: bool
    unrecorded: bool = False
    """Run by a scheduler that died before writing its bookkeeping (its result is stored, its request row
    unfinished): record it from the stored result (`services.runtime.recovery`)."""


@dataclass(frozen=True)
class Completion:
    """A request's terminal outcome: a domain result (`ForwardBackwardResult`, ...) or a `WorkError`."""

    request: QueuedRequest
    result: object

    @property
    def request_id(self) -> RequestId:
        return self.request.request_id

    @property
    def is_error(self) -> bool:
        return isinstance(self.result, WorkError)


def error_completion(
    request: QueuedRequest, message: str, category: Literal["user", "server"] = "user"
) -> Completion:
    """A request the scheduler itself fails (never schedulable): its result is a `WorkError`."""
    return Completion(request=request, result=WorkError(message=message, category=category))


@dataclass(frozen=True)
class PassSegment:
    """One model's (adapter's) contiguous share of a packed pass, in seq_id order."""

    model_id: ModelId
    tenant_id: TenantId
    requests: tuple[QueuedRequest, ...]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)


@dataclass(frozen=True)
class PassPlan:
    """One packed forward/backward pass over the base model: many adapters, grouped contiguously."""

    item_id: PlanItemId
    segments: tuple[PassSegment, ...]

    @property
    def requests(self) -> tuple[QueuedRequest, ...]:
        """All requests, segment by segment; `complete()` expects results in this order."""
        return tuple(r for seg in self.segments for r in seg.requests)

    @property
    def num_tokens(self) -> int:
        return sum(seg.num_tokens for seg in self.segments)

    @property
    def tenants(self) -> frozenset[TenantId]:
        return frozenset(seg.tenant_id for seg in self.segments)

    @property
    def model_ids(self) -> tuple[ModelId, ...]:
        return tuple(seg.model_id for seg in self.segments)


@dataclass(frozen=True)
class BarrierPlan:
    """One barrier request (optim_step / save / load / create) of one model, run on its own."""

    item_id: PlanItemId
    request: QueuedRequest

    @property
    def requests(self) -> tuple[QueuedRequest, ...]:
        return (self.request,)


@dataclass(frozen=True)
class SampleBatchPlan:
    """Sampling requests of any sessions, batched into one generate call."""

    item_id: PlanItemId
    requests: tuple[QueuedRequest, ...]


PlanItem = PassPlan | BarrierPlan | SampleBatchPlan


def models_held(item: PlanItem) -> tuple[ModelId, ...]:
    """Models whose ordering an item holds while in flight (sampling holds none)."""
    if isinstance(item, PassPlan):
        return item.model_ids
    if isinstance(item, BarrierPlan):
        return (item.request.model_id,)
    return ()


def pair_results(requests: Sequence[QueuedRequest], results: Sequence[object] | WorkError) -> list[Completion]:
    """Each request with its result (one `WorkError` fails them all); missing results are server errors."""
    if isinstance(results, WorkError):
        return [Completion(r, results) for r in requests]
    completions = [Completion(r, res) for r, res in zip(requests, results, strict=False)]
    missing = WorkError(f"backend returned {len(results)} results for {len(requests)} requests", "server")
    completions.extend(Completion(r, missing) for r in requests[len(results) :])
    return completions


@dataclass(frozen=True)
class StepPlan:
    """Everything to dispatch now, plus results the scheduler decided itself."""

    barriers: tuple[BarrierPlan, ...] = ()
    passes: tuple[PassPlan, ...] = ()
    sample_batches: tuple[SampleBatchPlan, ...] = ()
    rejected: tuple[Completion, ...] = ()
    """Requests that can never run (oversized, stale seq_id, malformed): write their error results now."""
    hold_s: float | None = None
    """A pass or sample batch is held for tenants expected soon: step again after new submissions, or
    after at most this many seconds. None: nothing held (step again when there is news)."""
    warm_models: frozenset[ModelId] = frozenset()
    """Models of the pass that completed last: their barriers run before this step's passes (`items`)."""

    @property
    def items(self) -> tuple[PlanItem, ...]:
        """Every item to dispatch (rejected completions are not items: nothing to run), in the order a
        loop that runs them one by one should use:

        - barriers of the models in the pass that completed last first: their adapters are still on the
          device (this step's pass would evict them when adapters outnumber the slots, and each barrier
          would bring its adapter back: two swaps per model and step at 512 tenants on 16 slots), and a
          client that waits on its `optim_step` sends its next request sooner;
        - then packed passes and sample batches (they carry every tenant's latency);
        - other barriers last (each holds up only its own model, which is not in this step's passes
          anyway; a slow save, or ten models' steps, must not delay everyone's pass)."""
        warm = tuple(b for b in self.barriers if b.request.model_id in self.warm_models)
        cold = tuple(b for b in self.barriers if b.request.model_id not in self.warm_models)
        return (*warm, *self.passes, *self.sample_batches, *cold)

    @property
    def is_empty(self) -> bool:
        return not self.items and not self.rejected


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics (gauges are current values, counters are totals since start)."""

    queued_by_model: dict[ModelId, int] = field(default_factory=dict)
    """Ordered requests not yet dispatched, in order or waiting for an earlier seq_id."""
    queued_by_tenant: dict[TenantId, int] = field(default_factory=dict)
    """The same plus queued samples, per tenant."""
    out_of_order_waiting: int = 0
    """Early arrivals held back by a missing seq_id."""
    samples_queued: int = 0
    in_flight_items: int = 0
    oldest_wait_s: float = 0.0
    """Age of the oldest queued request (clock now minus its `enqueued_at`)."""
    passes_planned: int = 0
    barriers_planned: int = 0
    sample_batches_planned: int = 0
    requests_rejected: int = 0
    tokens_planned: int = 0
    tenants_in_last_pass: int = 0
    tenants_per_pass_total: int = 0
    """Sum over passes of their tenant count; divide by `passes_planned` for the mean."""
    holds: int = 0
    """Steps that held a pass or sample batch for tenants expected soon."""

    @property
    def mean_tenants_per_pass(self) -> float:
        return self.tenants_per_pass_total / self.passes_planned if self.passes_planned else 0.0
