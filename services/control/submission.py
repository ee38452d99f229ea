"""Ordered submissions: idempotency by `(model_id, seq_id)`, request logging, and consumed seq ids.

Every training-side call of a model carries a seq id, and the run's unique `(model_id, seq_id)` request
row is the single source of truth for its request id: a retry (from any gateway process) finds the row and
gets the same id, never a 409. A new request is checked by its `Preparer` inside the same transaction that
logs it; if the check refuses it, the seq id is still consumed (a failed row, a `CONSUMED` marker on the
queue and an error result), because the SDK moves on to the next seq id and the model must not wait for
this one forever. A refusal is raised to the caller (4xx), or — for a `FailedSubmission` such as a
checkpoint name clash — reported through the future instead. Quota refusals (`QuotaExceeded`, 429) are the
exception: they are raised before anything is logged, so the SDK's retry of the same seq id can still be
accepted (`quotas` consumes the seq id only if the retries stop).

The work is queued after the commit, so a process killed in between (a gateway SIGKILLed) leaves a logged
request that is on no queue; its client's retry is a duplicate, and the duplicate queues it again: a retry
of a row still `queued` re-checks the retry's own body and queues the work, a retry of a seq id refused
at the edge queues the `CONSUMED` marker again. Delivery is at-least-once anyway and the scheduler drops a
copy of a request it already has (or finished), so a retry of a request that was queued costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import Conflict, ControlError, Invalid, NotFound, QuotaExceeded, Submitted
from services.control.context import ControlContext, TakenSeq, not_found, submission_facts
from services.control.quotas import QuotaGate
from services.control.registry import ServedModel
from services.db.ids import ModelId, RequestId, SamplingSessionId, TenantId
from services.db.request_log import mark_request_failed, record_request
from services.db.runs import RunFacts, reserve_seq_id
from services.scheduler.requests import RequestKind

MAX_SEQ_ID = 2**31 - 2
"""Largest seq id of a request on an existing model: `next_seq_id` (an int32 column) stores seq id + 1."""
REJECTED_KIND = "rejected"
"""Request-log kind of a seq id refused at the edge before its kind was known."""


class FailedSubmission(Exception):
    """A request accepted as a future that fails at once (e.g. a name clash): consumes its seq id."""

    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.message = message
        self.category = category


@dataclass(frozen=True)
class Prepared:
    """A checked request: what the scheduler sees and what the loop runs."""

    kind: RequestKind
    payload: object
    num_tokens: int = 0
    """Tokens the request puts into a pass (what packing counts)."""
    billed_tokens: int | None = None
    """What `tokens_per_minute` charges when it differs from `num_tokens` (T x K of a `(T, K)` target)."""
    sampling_session_id: SamplingSessionId | None = None
    """Logged on the request row (an ephemeral save names the sampling session it creates)."""


Preparer = Callable[[Session, RunFacts, ServedModel], Prepared]
"""Checks a new request inside its transaction; raises `ControlError` or `FailedSubmission` to refuse it.
A preparer that changes the run loads its row itself (`get_training_run`, same transaction)."""


@dataclass(frozen=True)
class OrderedCall:
    tenant: Tenant
    model_id: ModelId
    seq_id: int
    kind_name: str
    """The request log's kind (`forward_backward`, `optim_step`, `save_weights`, ...)."""
    prepare: Preparer


@dataclass
class _Decision:
    request_id: RequestId
    duplicate: bool = False
    requeue: bool = False
    """A duplicate whose first attempt may have died between commit and queueing: dispatch it again."""
    served: ServedModel | None = None
    prepared: Prepared | None = None
    refusal: ControlError | FailedSubmission | None = None


class OrderedSubmitter:
    """Submits seq-id-ordered requests of existing models."""

    def __init__(self, ctx: ControlContext) -> None:
        self._ctx = ctx

    async def submit(self, call: OrderedCall) -> Submitted:
        try:
            decision = await self._decide(call)
        except QuotaExceeded as exc:
            self._ctx.quotas.refused(call.tenant, call.model_id, call.seq_id, exc.retry_after_s, self.consume)
            raise
        if not decision.duplicate:
            self._ctx.accepted.add(decision.request_id, call.tenant.id, call.kind_name)
            self._dispatch(call, decision)
        elif decision.requeue:
            # The work again (checked from the retry's body), or the marker again; a refusal's error is not
            # published again: the future of a failed row is answered from the row.
            self._enqueue(call, decision)
        if isinstance(decision.refusal, ControlError):
            raise decision.refusal
        return Submitted(decision.request_id, call.model_id)

    async def consume(self, tenant: Tenant, model_id: ModelId, seq_id: int, error: str) -> None:
        """`reject_seq_id`: the seq id is used up by a request that failed at the edge."""
        if seq_id < 1:
            return  # seq 0 is the model's creation and negative ids never block anything

        def refuse(_db: Session, _run: RunFacts, _served: ServedModel) -> Prepared:
            raise FailedSubmission(error, "user")

        await self.submit(OrderedCall(tenant, model_id, seq_id, REJECTED_KIND, refuse))

    async def _decide(self, call: OrderedCall) -> _Decision:
        if not 1 <= call.seq_id <= MAX_SEQ_ID:
            raise Invalid(f"seq_id must be in [1, {MAX_SEQ_ID}] for requests on an existing model, got "
                          f"{call.seq_id}", field="seq_id")
        caller = call.tenant.id
        try:
            return await self._ctx.write_tx(lambda db: self._decide_tx(db, call), caller=caller)
        except IntegrityError:
            # Another process logged the same (model_id, seq_id) first: this is a retry of that request.
            return await self._ctx.write_tx(lambda db: self._decide_tx(db, call), caller=caller)

    def _decide_tx(self, db: Session, call: OrderedCall) -> _Decision:
        tenant_id = TenantId(call.tenant.id)
        quotas = None if call.kind_name == REJECTED_KIND else self._ctx.quotas
        counted = quotas is not None and quotas.concurrency_limit(call.tenant) is not None
        facts = submission_facts(db, tenant_id, call.model_id, call.seq_id, count_unfinished=counted)
        if facts is None:
            raise NotFound(not_found("model", call.model_id), field="model_id")
        run = facts.run
        if facts.taken is not None:
            return self._retry(db, run, facts.taken, call)
        served = self._ctx.registry.for_run(run.base_model)
        if quotas is not None:
            quotas.check_concurrency(db, call.tenant, model_id=call.model_id, seq_id=call.seq_id,
                                     unfinished=facts.unfinished)
        decision = _Decision(RequestId(""), served=served)
        try:
            decision.prepared = call.prepare(db, run, served)
        except QuotaExceeded:
            raise
        except (ControlError, FailedSubmission) as exc:
            decision.refusal = exc
        ssid = decision.prepared.sampling_session_id if decision.prepared else None
        row = record_request(db, tenant_id, call.kind_name, model_id=call.model_id,
                             sampling_session_id=ssid, seq_id=call.seq_id, now=self._ctx.clock())
        reserve_seq_id(db, tenant_id, call.model_id, call.seq_id, now=self._ctx.clock())
        if decision.refusal is None and quotas is not None:
            self._charge(quotas, call, decision)
        if decision.refusal is not None:
            error, category = _refusal_text(decision.refusal)
            mark_request_failed(db, tenant_id, row.id, error=error, category=category, now=self._ctx.clock())
        decision.request_id = row.id
        return decision

    def _retry(self, db: Session, run: RunFacts, existing: TakenSeq, call: OrderedCall) -> _Decision:
        """A duplicate; marked for re-queueing when the first attempt may never have reached the queue."""
        decision = _duplicate(existing.request_id, existing.kind, call)
        if existing.status == "failed" and not existing.started:  # refused at the edge: the marker again
            decision.served, decision.requeue = self._ctx.registry.for_run(run.base_model), True
        elif existing.status == "queued" and existing.kind == call.kind_name:
            served = self._ctx.registry.for_run(run.base_model)
            try:
                decision.prepared = call.prepare(db, run, served)
            except (ControlError, FailedSubmission):
                return decision  # the retry's body does not pass (any more): the logged request stands alone
            decision.served, decision.requeue = served, True
        return decision

    @staticmethod
    def _charge(quotas: QuotaGate, call: OrderedCall, decision: _Decision) -> None:
        """Charge the tokens last: a 429 rolls the whole transaction back (nothing logged, nothing reserved);
        a request too large for the tenant's bucket ever is refused like any invalid one."""
        assert decision.prepared is not None
        try:
            prepared = decision.prepared
            billed = prepared.num_tokens if prepared.billed_tokens is None else prepared.billed_tokens
            quotas.charge_tokens(call.tenant, billed)
        except QuotaExceeded:
            raise
        except ControlError as exc:
            decision.refusal = exc

    def _dispatch(self, call: OrderedCall, decision: _Decision) -> None:
        """After commit: queue the work, or consume the seq id and publish the error."""
        self._enqueue(call, decision)
        if decision.refusal is not None:
            self._ctx.fail_now(decision.request_id, *_refusal_text(decision.refusal))

    def _enqueue(self, call: OrderedCall, decision: _Decision) -> None:
        """The prepared work on the model's queue, or the `CONSUMED` marker when there is none to run."""
        assert decision.served is not None
        prepared = decision.prepared if decision.refusal is None else None
        if prepared is None:
            self._ctx.enqueue(decision.served, call.tenant, decision.request_id, call.model_id,
                              RequestKind.CONSUMED, call.seq_id)
            return
        self._ctx.enqueue(decision.served, call.tenant, decision.request_id, call.model_id, prepared.kind,
                          call.seq_id, payload=prepared.payload, num_tokens=prepared.num_tokens)

def _duplicate(request_id: str, logged_kind: str, call: OrderedCall) -> _Decision:
    # A rejected seq id answers any later submission of it with the rejection (the SDK moved on).
    if logged_kind not in (call.kind_name, REJECTED_KIND) and call.kind_name != REJECTED_KIND:
        raise Conflict(f"seq_id {call.seq_id} of model {call.model_id} was already used by a "
                       f"{logged_kind} request", field="seq_id")
    return _Decision(RequestId(request_id), duplicate=True)


def _refusal_text(refusal: ControlError | FailedSubmission) -> tuple[str, str]:
    if isinstance(refusal, FailedSubmission):
        return refusal.message, refusal.category
    return refusal.message, "user"
