"""`FutureOps.retrieve` and the result store's retention: a result answered to its owner is kept only for
`ControlOptions.answered_result_s` (a retry of a lost response gets the same answer within it), a result
nobody retrieved keeps its full TTL, and so does a sample recorded for `stable_reinforce`.

The request log is a dict (`futures.get_request` is replaced), the result store the in-process one on a fake
clock, the rest of the context real."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest

from services.auth.tenants import Tenant
from services.control import futures
from services.control.api import Done, Failed
from services.control.context import ControlContext, ControlOptions
from services.control.futures import FutureOps
from services.db.ids import RequestId
from services.jobqueue import InMemoryNotifier, InMemoryResultStore, InMemoryWorkQueue, ResultStatus, StoredResult
from tests.fake_clock import FakeClock

TENANT = cast(Tenant, SimpleNamespace(id="tenant-1"))
RESULT = {"metrics": {"loss:sum": 1.5}}
GRACE_S = 120.0


@dataclass
class Setup:
    clock: FakeClock
    results: InMemoryResultStore
    ctx: ControlContext
    ops: FutureOps
    rows: dict[str, SimpleNamespace] = field(default_factory=dict)

    def finish(self, request_id: str, *, record_stability: bool = False, accepted_here: bool = True) -> None:
        """What a scheduler loop leaves behind: the result stored, the request logged done."""
        self.results.put(RequestId(request_id), StoredResult(ResultStatus.OK, RESULT))
        self.rows[request_id] = SimpleNamespace(id=request_id, tenant_id=TENANT.id, kind="forward_backward",
                                                status="done", record_stability=record_stability,
                                                error=None, category=None)
        if accepted_here:
            self.ctx.accepted.add(request_id, TENANT.id, "forward_backward", keeps_result=record_stability)

    def retrieve(self, request_id: str) -> Any:
        return asyncio.run(self.ops.retrieve(TENANT, RequestId(request_id), 0.0))

    def stored(self, request_id: str) -> StoredResult | None:
        return self.results.get_nowait(RequestId(request_id))


def make_setup(monkeypatch: pytest.MonkeyPatch, answered_result_s: float = GRACE_S) -> Setup:
    clock = FakeClock()
    results = InMemoryResultStore(clock=clock)
    database = SimpleNamespace(sessions=SimpleNamespace(begin=contextlib.nullcontext))
    ctx = ControlContext(db=cast(Any, database), queue=InMemoryWorkQueue(), results=results,
                         notifier=InMemoryNotifier(), store=cast(Any, None), registry=cast(Any, None),
                         options=ControlOptions(answered_result_s=answered_result_s))
    setup = Setup(clock, results, ctx, FutureOps(ctx))
    monkeypatch.setattr(futures, "get_request",
                        lambda db, tenant_id, request_id: setup.rows.get(request_id)
                        if tenant_id == TENANT.id else None)
    return setup


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch) -> Setup:
    return make_setup(monkeypatch)


@pytest.mark.parametrize("accepted_here", [True, False], ids=["accepted-here", "read-from-the-log"])
def test_an_answered_result_is_kept_for_the_grace_then_dropped(setup: Setup, accepted_here: bool) -> None:
    setup.finish("answered", accepted_here=accepted_here)
    first = setup.retrieve("answered")
    assert first == Done("forward_backward", RESULT)
    setup.clock.now += GRACE_S - 1
    assert setup.retrieve("answered") == first  # a retry of a lost response: the same answer
    setup.clock.now += 1
    assert setup.stored("answered") is None  # not the rest of the hour
    late = setup.retrieve("answered")
    assert isinstance(late, Failed) and late.category == "user"
    assert "kept for an hour until it is first retrieved, then for 120 s" in late.error


def test_an_unanswered_result_keeps_its_full_ttl(setup: Setup) -> None:
    setup.finish("answered")
    setup.finish("unanswered")
    setup.retrieve("answered")
    setup.clock.now += 3599
    setup.results.put(RequestId("other"), StoredResult(ResultStatus.OK, 0))  # writes purge what expired
    assert setup.stored("answered") is None
    assert setup.retrieve("unanswered") == Done("forward_backward", RESULT)
    assert len(setup.results) == 2  # "unanswered" (now answered: 120 s more) and "other"


def test_a_sample_recorded_for_stable_reinforce_keeps_its_full_ttl(setup: Setup) -> None:
    """`stable_reinforce` reads the sample's result from the store after the client fetched it."""
    setup.finish("recorded-here", record_stability=True)
    setup.finish("recorded-elsewhere", record_stability=True, accepted_here=False)
    for request_id in ("recorded-here", "recorded-elsewhere"):
        assert setup.retrieve(request_id) == Done("forward_backward", RESULT)
    setup.clock.now += 3599
    assert setup.stored("recorded-here") is not None and setup.stored("recorded-elsewhere") is not None


def test_a_grace_of_zero_drops_the_result_once_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = make_setup(monkeypatch, answered_result_s=0.0)
    setup.finish("once")
    assert setup.retrieve("once") == Done("forward_backward", RESULT)
    assert setup.stored("once") is None
    assert isinstance(setup.retrieve("once"), Failed)  # answered from the log (and the message says 0 s)


def test_an_answer_from_the_log_of_a_failed_request_is_its_error(setup: Setup) -> None:
    setup.rows["failed"] = SimpleNamespace(id="failed", tenant_id=TENANT.id, kind="forward_backward",
                                           status="failed", record_stability=False, error="bad input",
                                           category="user")
    assert setup.retrieve("failed") == Failed("bad input", "user")
