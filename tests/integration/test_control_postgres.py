"""The control plane on PostgreSQL: the same request path as on SQLite, where concurrency is real.

Skipped when no PostgreSQL answers (see `services.db.testing`).
"""

from __future__ import annotations

import asyncio

import numpy as np
from conftest import BASE, Harness

from services.control.api import CheckpointRef, OptimStepDone, SaveOptions
from services.domain.training import AdamParams, Datum, ForwardBackwardResult, ForwardBackwardWork, LoraSpec


def test_training_round_trip_on_postgres(postgres_harness: Harness) -> None:
    h = postgres_harness
    t = h.tenant("acme")
    s = h.session(t)
    model = h.run(h.control.create_model(t, s, 0, BASE, LoraSpec(rank=4, seed=1), None)).model_id
    seq = np.random.default_rng(0).integers(0, 512, 11)
    work = ForwardBackwardWork(None, [Datum(seq[:-1], {"target_tokens": seq[1:]})])

    async def submit_concurrently() -> set[str]:
        # Retries racing each other (as from several gateway processes) get one request id.
        subs = await asyncio.gather(*(h.control.forward_backward(t, model, 1, work) for _ in range(4)))
        return {sub.request_id for sub in subs}

    ids = h.run(submit_concurrently())
    assert len(ids) == 1
    fb = ids.pop()
    opt = h.run(h.control.optim_step(t, model, 2, AdamParams(learning_rate=1e-2)))
    save = h.run(h.control.save(t, model, 3, "training", SaveOptions(name="pg")))
    result = h.done(t, fb)
    assert isinstance(result, ForwardBackwardResult) and result.metrics["loss:sum"] > 0
    assert isinstance(h.done(t, opt.request_id), OptimStepDone)
    ref = h.done(t, save.request_id)
    assert isinstance(ref, CheckpointRef)
    views, page = h.run(h.control.list_checkpoints(t, None, 10, 0))
    assert page.total_count == 1 and views[0].tinker_path == ref.tinker_path
