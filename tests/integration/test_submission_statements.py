"""An ordered submission reads what it decides on in one statement (`submission_facts`): the run, the row
that holds its seq id and, with a concurrency limit in force, the tenant's unfinished requests. At 512 SDK
tenants in cluster mode those were three round trips and a third of the gateway's database time (py-spy);
these tests pin the statement count and that the one statement answers as the three did, on SQLite and on
PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from conftest import BASE, Harness
from sqlalchemy import event

from services.auth.tenants import Tenant, create_tenant_with_key
from services.control.api import NotFound, QuotaExceeded
from services.db.tenants import TenantQuotas
from services.domain.training import AdamParams, LoraSpec

SPEC = LoraSpec(rank=4, seed=1)
HP = AdamParams(learning_rate=1e-3)


@contextmanager
def _statements(h: Harness) -> Iterator[list[str]]:
    seen: list[str] = []

    def note(*args: Any) -> None:
        # Only the submission's: the loop thread's bookkeeping of earlier work may run meanwhile.
        if not threading.current_thread().name.startswith(("scheduler:", "request-log:")):
            seen.append(args[2].lstrip().split(None, 1)[0].upper())

    event.listen(h.db.engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(h.db.engine, "before_cursor_execute", note)


def _tenant(h: Harness, name: str, limit: int | None) -> Tenant:
    with h.db.sessions.begin() as db:
        tenant, _ = create_tenant_with_key(db, name, quotas=TenantQuotas(max_concurrent_requests=limit))
    return tenant


def _model(h: Harness, tenant: Tenant) -> str:
    created = h.run(h.control.create_model(tenant, h.session(tenant), 0, BASE, SPEC, None))
    h.done(tenant, created.request_id)
    return created.model_id



@pytest.mark.parametrize("limit", [None, 50])
def test_a_submission_reads_in_one_select(harness_on_each_database: Harness, limit: int | None) -> None:
    h = harness_on_each_database
    tenant = _tenant(h, "acme", limit)
    model = _model(h, tenant)
    with _statements(h) as seen:
        first = h.run(h.control.optim_step(tenant, model, 1, HP))
    assert seen.count("SELECT") == 1, seen
    assert {"INSERT", "UPDATE"} <= set(seen)
    with _statements(h) as seen:
        retry = h.run(h.control.optim_step(tenant, model, 1, HP))
    assert retry.request_id == first.request_id  # the joined row is the seq id's holder
    assert seen.count("SELECT") == 1 and "INSERT" not in seen, seen


def test_the_one_select_counts_unfinished_requests_and_keeps_models_apart(
    harness_on_each_database: Harness,
) -> None:
    h = harness_on_each_database
    tenant, other = _tenant(h, "acme", 2), _tenant(h, "other", None)
    model, foreign = _model(h, tenant), _model(h, other)
    h.loop.stop()  # nothing runs: submissions stay unfinished
    h.run(h.control.optim_step(tenant, model, 3, HP))
    h.run(h.control.optim_step(tenant, model, 4, HP))
    with pytest.raises(QuotaExceeded, match="2 unfinished requests, its limit is 2"):
        h.run(h.control.optim_step(tenant, model, 5, HP))
    # Seq 1 is what the model waits for (the gap exemption still applies at the limit).
    h.run(h.control.optim_step(tenant, model, 1, HP))
    with pytest.raises(NotFound):
        h.run(h.control.optim_step(tenant, foreign, 1, HP))
