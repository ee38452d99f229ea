"""`DatabaseCompletionHook` on both backends: `running` is written only for items still in flight after
`running_after_s` (on the marker's thread), and finishing records pass id, start time, tokens and usage."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

from services.control.recording import DatabaseCompletionHook
from services.db import Database, request_log, runs, sessions, tenants
from services.db.ids import ModelId, RequestId, TenantId
from services.db.models import RequestRow
from services.db.testing import wipe_tables
from services.db.usage import usage_totals
from services.domain.training import ForwardBackwardResult, WorkError
from services.scheduler.requests import Completion, QueuedRequest, RequestKind
from services.scheduler.requests import ModelId as QueueModelId
from services.scheduler.requests import RequestId as QueueRequestId
from services.scheduler.requests import TenantId as QueueTenantId


def _queued(database: Database, seq_ids: range) -> list[QueuedRequest]:
    wipe_tables(database.engine)
    with database.sessions.begin() as db:
        tenant_id = TenantId(tenants.create_tenant(db, "acme").id)
        session_id = sessions.create_session(db, tenant_id).id
        model_id = ModelId(runs.create_training_run(db, tenant_id, session_id, 0, base_model="m", lora_rank=2).id)
        rows = [request_log.record_request(db, tenant_id, "forward_backward", model_id=model_id, seq_id=seq)
                for seq in seq_ids]
    return [QueuedRequest(QueueRequestId(row.id), QueueTenantId(tenant_id), QueueModelId(model_id),
                          RequestKind.FORWARD_BACKWARD, row.seq_id, 7, 0.0, None) for row in rows]


def _row(database: Database, request: QueuedRequest) -> RequestRow:
    with database.sessions.begin() as db:
        row = request_log.get_request(db, TenantId(request.tenant_id), RequestId(request.request_id))
    assert row is not None
    return row


def _no_store(completions: Sequence[Completion]) -> None:
    """These tests read the request log only (tests/integration/test_result_order.py checks the store)."""


def _result() -> ForwardBackwardResult:
    return ForwardBackwardResult([], {"loss:sum": 1.0})


def test_a_quick_item_is_logged_done_with_its_pass_and_start_without_a_running_write(database: Database) -> None:
    ok, bad = _queued(database, range(1, 3))
    hook = DatabaseCompletionHook(database, running_after_s=3600.0)
    hook.started([ok, bad], "pass-1")
    assert _row(database, ok).status == "queued"  # nothing written at the start
    finished = hook.finished([Completion(ok, _result()), Completion(bad, WorkError("boom", "user"))], "pass-1",
                             _no_store)
    assert [c.request_id for c in finished] == [ok.request_id, bad.request_id]
    done, failed = _row(database, ok), _row(database, bad)
    assert (done.status, done.pass_id, done.num_tokens) == ("done", "pass-1", 7) and done.started_at is not None
    assert (failed.status, failed.pass_id, failed.error) == ("failed", "pass-1", "boom")
    assert failed.started_at is not None and done.finished_at is not None
    assert done.started_at <= done.finished_at
    with database.sessions.begin() as db:
        totals = usage_totals(db, TenantId(ok.tenant_id), since=done.finished_at - timedelta(hours=1))
    assert totals["forward_backward"].tokens == 7 and totals["forward_backward"].requests == 1


def test_an_item_still_running_after_the_delay_is_marked_running(database: Database) -> None:
    (request,) = _queued(database, range(1, 2))
    hook = DatabaseCompletionHook(database, running_after_s=0.0)
    hook.started([request], "pass-2")
    deadline = time.monotonic() + 30
    while (running := _row(database, request)).status != "running":  # the marker's thread writes it
        assert time.monotonic() < deadline, "the request was never marked running"
        time.sleep(0.01)
    assert running.pass_id == "pass-2" and running.started_at is not None
    hook.finished([Completion(request, _result())], "pass-2", _no_store)
    done = _row(database, request)
    assert done.status == "done" and done.started_at == running.started_at


def test_without_a_delay_running_is_written_at_the_start(database: Database) -> None:
    (request,) = _queued(database, range(1, 2))
    hook = DatabaseCompletionHook(database, running_after_s=None)
    hook.started([request], "pass-3")
    assert _row(database, request).status == "running"
    hook.finished([Completion(request, _result())], "pass-3", _no_store)
    assert _row(database, request).status == "done"
