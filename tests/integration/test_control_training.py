"""ServiceControlPlane + SchedulerLoop + a real Engine (tiny model, SQLite), driven without HTTP: model
creation, seq-id ordering and idempotency, rejected seq ids, quotas, save_state → load → continue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from conftest import BASE, Harness

from services.auth.tenants import Tenant
from services.control.api import (
    CheckpointRef,
    Done,
    Failed,
    Invalid,
    ModelCreated,
    NotFound,
    OptimStepDone,
    QuotaExceeded,
    SaveOptions,
    WeightsLoaded,
)
from services.db.ids import ModelId, RequestId, TenantId
from services.db.request_log import get_request
from services.domain.training import (
    AdamParams,
    AdapterId,
    Datum,
    ForwardBackwardResult,
    ForwardBackwardWork,
    LoraSpec,
)
from services.scheduler.requests import QueuedRequest, RequestKind
from worker.engine.engine import Engine, EngineConfig

SPEC = LoraSpec(rank=4, seed=1)
HP = AdamParams(learning_rate=2e-2)


def _datum(rng: np.random.Generator, n: int, vocab: int = 512) -> Datum:
    seq = rng.integers(0, vocab, n + 1)
    return Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(n, np.float32)})


def _loss(result: object) -> float:
    assert isinstance(result, ForwardBackwardResult), result
    return result.metrics["loss:sum"]


class DiedBeforeQueueing(Exception):
    """Stands for the gateway process SIGKILLed after its commit and before the queue call."""


def _dies_before_queueing(h: Harness, monkeypatch: pytest.MonkeyPatch, kind: RequestKind) -> list[RequestKind]:
    """The first enqueue of `kind` never reaches the queue (its request is logged); returns the kinds queued."""
    enqueue, queued, dead = h.queue.enqueue, [], []

    def dying(base_model: str, request: QueuedRequest) -> str:
        if request.kind is kind and not dead:
            dead.append(request)
            raise DiedBeforeQueueing(request.request_id)
        queued.append(request.kind)
        return enqueue(base_model, request)

    monkeypatch.setattr(h.queue, "enqueue", dying)
    return queued


def _done_soon(h: Harness, tenant: Tenant, request_id: RequestId) -> object:
    """The result of a request that must succeed, within 20 s (a lost request would stay pending)."""
    state = h.result(tenant, request_id, timeout_s=20)
    assert isinstance(state, Done), state
    return state.result


def _one_step_reference(model_dir: Path, train: list[Datum], probe: list[Datum]) -> tuple[object, object]:
    """`train`'s forward_backward, one optimizer step, then `probe`'s forward: on a plain engine, alone."""
    ref = Engine(model_dir, name=BASE, config=EngineConfig(device="cpu", dtype="float32"))
    ref.create_adapter(AdapterId("x"), SPEC)
    ref_fb = ref.forward_backward([ForwardBackwardWork(AdapterId("x"), train)])[0]
    ref.optim_step(AdapterId("x"), HP)
    return ref_fb, ref.forward_backward([ForwardBackwardWork(AdapterId("x"), probe, forward_only=True)])[0]


def test_seq_ids_run_in_order_and_duplicates_share_request_ids(
    harness: Harness, tiny_model_dir: Path
) -> None:
    h = harness
    t = h.tenant("acme")
    s = h.session(t)
    created = h.run(h.control.create_model(t, s, 0, BASE, SPEC, {"purpose": "test"}))
    assert h.run(h.control.create_model(t, s, 0, BASE, SPEC, None)).request_id == created.request_id
    model = created.model_id
    assert model == f"{s}:train:0"
    assert h.done(t, created.request_id) == ModelCreated(model)

    rng = np.random.default_rng(0)
    train, probe = [_datum(rng, 12), _datum(rng, 7)], [_datum(rng, 9)]
    # The SDK sends later chunks first: 3 (forward) and 2 (optim_step) arrive before 1 (forward_backward).
    fwd = h.run(h.control.forward_backward(t, model, 3, ForwardBackwardWork(None, probe, forward_only=True)))
    opt = h.run(h.control.optim_step(t, model, 2, HP))
    assert h.run(h.control.optim_step(t, model, 2, HP)).request_id == opt.request_id
    fb = h.run(h.control.forward_backward(t, model, 1, ForwardBackwardWork(None, train)))
    assert (
        h.run(h.control.forward_backward(t, model, 1, ForwardBackwardWork(None, train))).request_id
        == fb.request_id
    )
    assert len({fwd.request_id, opt.request_id, fb.request_id}) == 3

    ref_fb, ref_fwd = _one_step_reference(tiny_model_dir, train, probe)

    assert abs(_loss(h.done(t, fb.request_id)) - _loss(ref_fb)) <= 1e-5
    assert isinstance(h.done(t, opt.request_id), OptimStepDone)
    # The forward saw the optimizer step: seq 3 ran after seq 2 although it arrived first.
    assert abs(_loss(h.done(t, fwd.request_id)) - _loss(ref_fwd)) <= 1e-5
    with h.db.sessions.begin() as db:
        row = get_request(db, TenantId(t.id), fb.request_id)
        assert row is not None and row.status == "done" and row.num_tokens == 19 and row.pass_id


def test_rejected_seq_id_does_not_block_the_model(harness: Harness) -> None:
    h = harness
    t = h.tenant("acme")
    model = h.run(h.control.create_model(t, h.session(t), 0, BASE, SPEC, None)).model_id
    rng = np.random.default_rng(1)
    h.run(h.control.reject_seq_id(t, model, 1, "body could not be decoded"))
    h.run(h.control.reject_seq_id(t, model, 1, "again"))  # idempotent
    retry = h.run(h.control.forward_backward(t, model, 1, ForwardBackwardWork(None, [_datum(rng, 5)])))
    rejected = h.result(t, retry.request_id)
    assert (
        isinstance(rejected, Failed)
        and "could not be decoded" in rejected.error
        and rejected.category == "user"
    )

    bad = Datum(np.array([1, 2, 9999]), {"target_tokens": np.array([2, 3, 4])})
    with pytest.raises(Invalid) as refused:
        h.run(h.control.forward_backward(t, model, 2, ForwardBackwardWork(None, [bad])))
    assert "outside the vocabulary" in refused.value.message

    fb = h.run(h.control.forward_backward(t, model, 3, ForwardBackwardWork(None, [_datum(rng, 6)])))
    opt = h.run(h.control.optim_step(t, model, 4, HP))
    assert _loss(h.done(t, fb.request_id)) > 0
    assert isinstance(h.done(t, opt.request_id), OptimStepDone)


def test_model_quota_and_served_base_models(harness: Harness) -> None:
    h = harness
    t = h.tenant("small", max_models=1)
    s = h.session(t)
    first = h.run(h.control.create_model(t, s, 0, BASE, SPEC, None))
    # A retry of the same creation is not a new model.
    assert h.run(h.control.create_model(t, s, 0, BASE, SPEC, None)).request_id == first.request_id
    with pytest.raises(QuotaExceeded):
        h.run(h.control.create_model(t, s, 1, BASE, SPEC, None))
    with pytest.raises(Invalid) as unknown:
        h.run(h.control.create_model(t, s, 2, "no/such-model", SPEC, None))
    assert BASE in unknown.value.message
    with pytest.raises(Invalid):
        h.run(h.control.create_model(t, s, 3, BASE, LoraSpec(rank=100_000), None))
    info = h.run(h.control.get_info(t, first.model_id))
    assert info.lora == SPEC and info.base.name == BASE


def test_save_state_then_load_into_a_new_model_continues_training(harness: Harness) -> None:
    h = harness
    t = h.tenant("acme")
    s = h.session(t)
    a = h.run(h.control.create_model(t, s, 0, BASE, SPEC, None)).model_id
    rng = np.random.default_rng(2)
    batches = [[_datum(rng, 10), _datum(rng, 6)] for _ in range(2)]
    h.run(h.control.forward_backward(t, a, 1, ForwardBackwardWork(None, batches[0])))
    h.run(h.control.optim_step(t, a, 2, HP))
    save = h.run(h.control.save(t, a, 3, "training", SaveOptions(name="ckpt", ttl_seconds=7200)))
    ref = h.done(t, save.request_id)
    assert isinstance(ref, CheckpointRef) and ref.tinker_path == f"tinker://{a}/weights/ckpt"
    assert ref.kind == "training" and (ref.size_bytes or 0) > 0

    clash = h.run(h.control.save(t, a, 4, "training", SaveOptions(name="ckpt")))
    failed = h.result(t, clash.request_id)
    assert isinstance(failed, Failed) and failed.category == "user" and "already exists" in failed.error

    b_sub = h.run(h.control.load(t, path=ref.tinker_path, with_optimizer=True, session_id=s, model_seq_id=1))
    b = ModelId(f"{s}:train:1")
    assert b_sub.model_id == b
    assert h.done(t, b_sub.request_id) == WeightsLoaded(b, ref.tinker_path)
    assert h.run(h.control.get_info(t, b)).lora == SPEC

    # Both continue from the checkpoint (weights and Adam moments): identical steps give identical losses.
    losses = {}
    for model, seq in ((a, 5), (b, 1)):
        h.run(h.control.forward_backward(t, model, seq, ForwardBackwardWork(None, batches[1])))
        h.run(h.control.optim_step(t, model, seq + 1, HP))
        probe = h.run(
            h.control.forward_backward(
                t, model, seq + 2, ForwardBackwardWork(None, batches[0], forward_only=True)
            )
        )
        losses[model] = _loss(h.done(t, probe.request_id))
    assert abs(losses[a] - losses[b]) <= 1e-5

    views, page = h.run(h.control.list_checkpoints(t, a, 10, 0))
    assert [v.checkpoint_id for v in views] == ["weights/ckpt"] and page.total_count == 1
    assert views[0].expires_at is not None
    run = h.run(h.control.get_training_run(t, a))
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == ref.tinker_path
    usage = h.run(h.control.usage(t))
    assert usage["forward_backward_tokens"] > 0 and usage["checkpoint_bytes"] > 0


def test_concurrent_submissions_on_sqlite(harness: Harness) -> None:
    """Parallel chunks and racing retries (the SDK sends chunks 2..n concurrently) on one SQLite file."""
    h = harness
    t = h.tenant("acme")
    model = h.run(h.control.create_model(t, h.session(t), 0, BASE, SPEC, None)).model_id
    rng = np.random.default_rng(5)
    works = {seq: ForwardBackwardWork(None, [_datum(rng, 4 + seq)]) for seq in (1, 2, 3)}

    async def submit_all() -> list[str]:
        calls = [h.control.forward_backward(t, model, seq, works[seq]) for seq in (3, 2, 3, 1, 2, 1, 3)]
        return [sub.request_id for sub in await asyncio.gather(*calls)]

    ids = h.run(submit_all())
    by_seq = dict(zip((3, 2, 3, 1, 2, 1, 3), ids, strict=True))
    assert len(set(ids)) == 3
    for seq, request_id in by_seq.items():
        assert ids.count(request_id) == (3 if seq == 3 else 2)
        assert _loss(h.done(t, RequestId(request_id))) > 0


def test_a_request_accepted_here_is_answered_without_the_log_then_forgotten(harness: Harness) -> None:
    """Owner and kind of a just-submitted request come from `ControlContext.accepted` (no request-log read
    on the SDK's first poll); once answered the entry goes, and later polls are answered from the log."""
    h = harness
    t, other = h.tenant("acme"), h.tenant("other")
    model = h.run(h.control.create_model(t, h.session(t), 0, BASE, SPEC, None)).model_id
    accepted = h.control.ctx.accepted
    work = ForwardBackwardWork(None, [_datum(np.random.default_rng(6), 5)])
    fb = h.run(h.control.forward_backward(t, model, 1, work))
    entry = accepted.get(fb.request_id)
    assert entry is not None and (entry.tenant_id, entry.kind) == (t.id, "forward_backward")
    with pytest.raises(NotFound):  # the entry names its owner: another tenant still gets "not found"
        h.run(h.control.retrieve(other, fb.request_id, 0.0))
    first = h.done(t, fb.request_id)
    assert accepted.get(fb.request_id) is None
    assert _loss(h.done(t, fb.request_id)) == _loss(first)  # answered again, from the log and the store
    with h.db.sessions.begin() as db:
        row = get_request(db, TenantId(t.id), fb.request_id)
        assert row is not None and row.status == "done" and row.pass_id and row.started_at is not None


def test_the_legacy_in_place_load_takes_the_checkpoints_lora_config(harness: Harness) -> None:
    """`load_weights` with model_id + seq_id replaces an existing model's adapter; the run row then records
    the checkpoint's rank (the preparer loads and changes the row in the submission's transaction)."""
    h = harness
    t = h.tenant("acme")
    s = h.session(t)
    a = h.run(h.control.create_model(t, s, 0, BASE, SPEC, None)).model_id
    ref = h.done(t, h.run(h.control.save(t, a, 1, "training", SaveOptions(name="ckpt"))).request_id)
    assert isinstance(ref, CheckpointRef)
    b = h.run(h.control.create_model(t, s, 1, BASE, LoraSpec(rank=8, seed=2), None)).model_id
    assert h.run(h.control.get_info(t, b)).lora.rank == 8
    loaded = h.run(h.control.load(t, path=ref.tinker_path, with_optimizer=True, model_id=b, seq_id=1))
    assert h.done(t, loaded.request_id) == WeightsLoaded(b, ref.tinker_path)
    assert h.run(h.control.get_info(t, b)).lora == SPEC
    with pytest.raises(NotFound):  # another tenant's model is unknown to it, through the same path
        h.run(h.control.load(h.tenant("other"), path=ref.tinker_path, with_optimizer=True, model_id=b,
                             seq_id=2))


# -- a process killed between logging a request and queueing it (found by `make chaos` seed 2) ---------------
def test_a_request_logged_but_never_queued_runs_once_on_the_retry(
    harness: Harness, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry of a submission whose row is still `queued` queues it again; a copy the scheduler already
    has is dropped (the step is applied once), and a retry of a finished request queues nothing."""
    h = harness
    t = h.tenant("acme")
    model = h.run(h.control.create_model(t, h.session(t), 0, BASE, SPEC, None)).model_id
    queued = _dies_before_queueing(h, monkeypatch, RequestKind.OPTIM_STEP)
    rng = np.random.default_rng(7)
    train, probe = [_datum(rng, 10)], [_datum(rng, 6)]
    fb = h.run(h.control.forward_backward(t, model, 1, ForwardBackwardWork(None, train)))
    with pytest.raises(DiedBeforeQueueing):
        h.run(h.control.optim_step(t, model, 2, HP))
    # The SDK retries on the new gateway: the same seq id is the same request, and now it is queued.
    opt = h.run(h.control.optim_step(t, model, 2, HP))
    assert queued.count(RequestKind.OPTIM_STEP) == 1
    # A second copy, queued again only if the first is still queued (the loop may have run it already).
    assert h.run(h.control.optim_step(t, model, 2, HP)).request_id == opt.request_id
    copies = queued.count(RequestKind.OPTIM_STEP)
    assert copies in (1, 2)
    assert isinstance(_done_soon(h, t, opt.request_id), OptimStepDone)
    assert h.run(h.control.optim_step(t, model, 2, HP)).request_id == opt.request_id
    assert queued.count(RequestKind.OPTIM_STEP) == copies  # none once it was done
    fwd = h.run(h.control.forward_backward(t, model, 3, ForwardBackwardWork(None, probe, forward_only=True)))

    ref_fb, ref_fwd = _one_step_reference(tiny_model_dir, train, probe)
    assert abs(_loss(h.done(t, fb.request_id)) - _loss(ref_fb)) <= 1e-5
    assert abs(_loss(h.done(t, fwd.request_id)) - _loss(ref_fwd)) <= 1e-5  # exactly one optimizer step


def test_a_model_created_but_never_queued_is_created_on_the_retry(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness
    t = h.tenant("acme")
    s = h.session(t)
    _dies_before_queueing(h, monkeypatch, RequestKind.CREATE)
    with pytest.raises(DiedBeforeQueueing):
        h.run(h.control.create_model(t, s, 0, BASE, SPEC, None))
    created = h.run(h.control.create_model(t, s, 0, BASE, SPEC, None))
    assert _done_soon(h, t, created.request_id) == ModelCreated(created.model_id)
    fb = h.run(h.control.forward_backward(t, created.model_id, 1,
                                          ForwardBackwardWork(None, [_datum(np.random.default_rng(8), 5)])))
    assert _loss(_done_soon(h, t, fb.request_id)) > 0


def test_a_refusal_whose_marker_was_never_queued_unblocks_the_model_on_the_retry(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seq id refused at the edge is consumed by a marker on the queue; lost with the process, the retry
    (refused again from the log) queues it, or the model's next requests would wait for that seq id forever."""
    h = harness
    t = h.tenant("acme")
    model = h.run(h.control.create_model(t, h.session(t), 0, BASE, SPEC, None)).model_id
    _dies_before_queueing(h, monkeypatch, RequestKind.CONSUMED)
    bad = ForwardBackwardWork(None, [Datum(np.array([1, 2, 9999]), {"target_tokens": np.array([2, 3, 4])})])
    with pytest.raises(DiedBeforeQueueing):
        h.run(h.control.forward_backward(t, model, 1, bad))
    retry = h.run(h.control.forward_backward(t, model, 1, bad))
    refused = h.result(t, retry.request_id, timeout_s=20)
    assert isinstance(refused, Failed) and "outside the vocabulary" in refused.error
    good = ForwardBackwardWork(None, [_datum(np.random.default_rng(9), 5)])
    fb = h.run(h.control.forward_backward(t, model, 2, good))
    opt = h.run(h.control.optim_step(t, model, 3, HP))
    assert _loss(_done_soon(h, t, fb.request_id)) > 0
    assert isinstance(_done_soon(h, t, opt.request_id), OptimStepDone)
