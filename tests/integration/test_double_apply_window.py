"""The scheduler-and-replica double-apply window, closed (services/runtime/journal.py, "applied").

The hole: a scheduler dispatches an `optim_step` that carries a snapshot order; the replica applies it,
writes the snapshot and answers; the scheduler commits the snapshot pointer (the log is cleared) and dies
before the result is stored. The replica that held the adapter dies too. The successor re-dispatches the
step with the same request id; the adapter is restored on another replica from a snapshot that already
contains the step, and the replica that remembered the request id is gone. Before the fix the step was
applied a second time.

Real parts throughout: two worker replicas (`ReplicaHost` on threads: engine, executor, Redis endpoint with
heartbeats), `ReplicaPool`s over the Redis link, placement and journal on the shared Redis (a scratch
prefix). "The scheduler dies" is its pool being abandoned after the commit; "the replica dies" is its
heartbeat stopping without a goodbye, as a SIGKILL does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deploy.cluster_wiring import cluster_config
from deploy.settings import ClusterSettings
from services.domain.training import AdamParams, AdapterId, ForwardBackwardWork, LoraSpec
from services.runtime.commands import CreateAdapter, ForwardBackward, OptimStep
from services.runtime.journal import RedisJournal, RedisPlacement
from services.runtime.redis_replicas import ClusterKeys, RedisReplicaLink, connect
from services.runtime.replica_pool import PoolConfig, ReplicaPool
from services.scheduler.requests import QueuedRequest, RequestKind
from tests.integration.cluster_support import (
    BASE,
    LEARNING_RATE,
    RANK,
    REDIS_URL,
    cluster_settings,
    domain_datum,
    max_difference,
    scratch_prefix,
    seed_of,
    tenant_batches,
)
from tests.required import require_redis
from worker.engine.engine import Engine, EngineConfig
from worker.serve.replica import ReplicaHost

ADAPTER = AdapterId("window-adapter")
STEPS = 2  # the second optim_step carries the snapshot order (snapshot_every_steps=2)
PARAMS = AdamParams(learning_rate=LEARNING_RATE, grad_clip_norm=1.0)
"""Clipping makes the step's answer carry its gradient norm: a second application (no gradient left)
would answer without it, so the test sees a re-applied step in the answer as well as in the log."""


@pytest.fixture
def settings(tmp_path: Path, tiny_model_dir: Path) -> Iterator[ClusterSettings]:
    require_redis()
    with scratch_prefix() as prefix:
        yield cluster_settings(tmp_path / "data", tiny_model_dir, "postgresql://unused/none", REDIS_URL, prefix)


def test_a_step_inside_a_snapshot_is_not_applied_again_when_scheduler_and_replica_die(
        settings: ClusterSettings, tiny_model_dir: Path) -> None:
    config = cluster_config(settings)
    first = ReplicaHost(config.spec(BASE), config, replica_id="a-first")
    second = ReplicaHost(config.spec(BASE), config, replica_id="b-second")
    try:
        old = _pool(settings, fence=1)
        _dispatch(old, _request("create", 0, RequestKind.CREATE,
                                CreateAdapter("m", ADAPTER, LoraSpec(rank=RANK, seed=seed_of(0)))))
        assert old.placement()[ADAPTER] == first.replica_id
        in_flight = None
        for step, batch in enumerate(tenant_batches(0, STEPS), start=1):
            work = ForwardBackwardWork(ADAPTER, [domain_datum(t) for t in batch])
            _dispatch(old, _request(f"fb-{step}", 2 * step - 1, RequestKind.FORWARD_BACKWARD, ForwardBackward(work)))
            in_flight = _request(f"optim-{step}", 2 * step, RequestKind.OPTIM_STEP,
                                 OptimStep(ADAPTER, PARAMS))
            answered = _dispatch(old, in_flight)
        journal = RedisJournal(connect(settings.redis_url), ClusterKeys(BASE, settings.redis_prefix))
        pointer = journal.snapshot(ADAPTER)
        assert pointer is not None and journal.entries(ADAPTER) == []  # the step's snapshot is committed
        assert set(pointer.applied) == {"optim-2"}

        old.close()  # the scheduler dies before storing optim-2's result ...
        first.stop(leave=False)  # ... and so does the replica that remembered it

        successor = _pool(settings, fence=2)
        assert in_flight is not None
        again = _dispatch(successor, in_flight)  # re-dispatched with the same request id
        assert successor.failovers == 1 and successor.restores == 1
        assert successor.placement()[ADAPTER] == second.replica_id
        # The successor logs the re-sent step before dispatching it, so the restore replays it: the seeded
        # memory answers it there and on the retry. Without the fix it ran again, on no gradient: a different
        # answer (no grad_norm).
        assert again == answered

        saved = settings.data_dir / "check" / "final"
        successor.save_adapter(ADAPTER, saved, with_optimizer=False)
        successor.close()
        difference = max_difference(_weights(saved), _reference(tiny_model_dir))

        print(f"max |after the double failure - uninterrupted| = {difference:.2e}")

        assert difference <= 1e-5
    finally:
        first.stop(leave=False)
        second.stop()


def _pool(settings: ClusterSettings, *, fence: int) -> ReplicaPool:
    client, keys = connect(settings.redis_url), ClusterKeys(BASE, settings.redis_prefix)
    link = RedisReplicaLink(client, keys, heartbeat_ttl_s=settings.heartbeat_ttl_seconds)
    config = PoolConfig(snapshot_dir=settings.resolved_snapshot_dir.resolve(),
                        snapshot_every_steps=settings.snapshot_every_steps, replica_wait_s=30)
    return ReplicaPool(BASE, link, RedisPlacement(client, keys), RedisJournal(client, keys), config,
                       fence=lambda: fence)


def _request(request_id: str, seq_id: int, kind: RequestKind, payload: object) -> QueuedRequest:
    return QueuedRequest(request_id, "tenant", "m", kind, seq_id, payload=payload)


def _dispatch(pool: ReplicaPool, request: QueuedRequest) -> object:
    """What the loop does for one plan item: tell the pool which request runs (TrackingHook), then run it."""
    pool.context.started([request])
    payload = request.payload
    if isinstance(payload, CreateAdapter):
        return pool.create_adapter(payload.adapter_id, payload.spec)
    if isinstance(payload, ForwardBackward):
        return pool.forward_backward([payload.work])
    assert isinstance(payload, OptimStep)
    return pool.optim_step(payload.adapter_id, payload.params)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    raw = load_file(str(path / "adapter_model.safetensors"))
    return {k.removeprefix("base_model.model.").removesuffix(".weight"): v for k, v in raw.items()}


def _reference(model_dir: Path) -> dict[str, torch.Tensor]:
    """The same steps, each applied once, on an in-process engine."""
    engine = Engine(model_dir, name=BASE, config=EngineConfig(device="cpu", dtype="float32"))
    engine.create_adapter(ADAPTER, LoraSpec(rank=RANK, seed=seed_of(0)))
    for batch in tenant_batches(0, STEPS):
        engine.forward_backward([ForwardBackwardWork(ADAPTER, [domain_datum(t) for t in batch])])
        engine.optim_step(ADAPTER, PARAMS)
    return {name: p.detach().clone() for name, p in engine.adapter(ADAPTER).params.items()}
