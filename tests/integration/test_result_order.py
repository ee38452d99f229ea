"""A finished request's result is stored before its request row says it finished (issue 16).

The other order let a poll read the row as `done`, look for the result in the gap and answer "the result
is no longer available". The store here is the real in-memory one, noting from its own database session
what a poll would read for the request at the moment the result is put: still unfinished.
"""

from __future__ import annotations

import numpy as np

from services.control.recording import DatabaseCompletionHook
from services.db import Database, request_log, runs, sessions, tenants
from services.db.ids import ModelId, TenantId
from services.db.models import RequestRow
from services.db.testing import wipe_tables
from services.domain.training import Datum, ForwardBackwardResult, ForwardBackwardWork
from services.jobqueue.memory import InMemoryNotifier, InMemoryResultStore, InMemoryWorkQueue
from services.jobqueue.protocol import DEFAULT_RESULT_TTL_S, StoredResult
from services.runtime.commands import ForwardBackward
from services.runtime.loop import SchedulerLoop
from services.scheduler.requests import ModelId as QueueModelId
from services.scheduler.requests import QueuedRequest, RequestId, RequestKind
from services.scheduler.requests import TenantId as QueueTenantId
from worker.engine.engine import Engine, EngineConfig

BASE = "order-model"


class ObservedResults(InMemoryResultStore):
    """The in-memory result store, noting each request row's status (read in its own transaction) at put."""

    def __init__(self, database: Database) -> None:
        super().__init__()
        self._database = database
        self.status_at_put: dict[str, str] = {}

    def put(self, request_id: RequestId, result: StoredResult, ttl_s: float = DEFAULT_RESULT_TTL_S) -> None:
        with self._database.sessions.begin() as db:
            row = db.get(RequestRow, request_id)
            self.status_at_put[request_id] = row.status if row is not None else "missing"
        super().put(request_id, result, ttl_s)


def _forward_request(database: Database, vocab: int) -> QueuedRequest:
    wipe_tables(database.engine)
    with database.sessions.begin() as db:
        tenant_id = TenantId(tenants.create_tenant(db, "acme").id)
        session_id = sessions.create_session(db, tenant_id).id
        model_id = ModelId(runs.create_training_run(db, tenant_id, session_id, 0, base_model=BASE, lora_rank=2).id)
        row = request_log.record_request(db, tenant_id, "forward", model_id=model_id, seq_id=0)
    tokens = np.arange(1, 9) % vocab
    work = ForwardBackwardWork(None, [Datum(tokens[:-1], {"target_tokens": tokens[1:]})], forward_only=True)
    return QueuedRequest(RequestId(row.id), QueueTenantId(tenant_id), QueueModelId(model_id), RequestKind.FORWARD,
                         0, len(tokens) - 1, 0.0, ForwardBackward(work))


def test_the_loop_stores_a_result_before_the_request_is_logged_done(database: Database, tiny_model_dir) -> None:  # noqa: ANN001
    engine = Engine(tiny_model_dir, name=BASE, config=EngineConfig(device="cpu", dtype="float32"))
    request = _forward_request(database, engine.info.vocab_size)
    queue, results = InMemoryWorkQueue(), ObservedResults(database)
    loop = SchedulerLoop(BASE, engine, queue, results, InMemoryNotifier(),
                         hook=DatabaseCompletionHook(database, running_after_s=None))
    queue.enqueue(BASE, request)
    for _ in range(5):  # a plan may hold an item for a round; it runs within a few iterations
        loop.run_once(0.0)
        if request.request_id in results.status_at_put:
            break
    assert results.status_at_put == {request.request_id: "running"}  # a poll then still waits for it
    with database.sessions.begin() as db:
        row = db.get(RequestRow, request.request_id)
        assert row is not None and row.status == "done"
    stored = results.get_nowait(request.request_id)
    assert stored is not None and isinstance(stored.value, ForwardBackwardResult)
