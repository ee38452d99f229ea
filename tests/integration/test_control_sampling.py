"""Sampling through the control plane: sessions from a checkpoint, from an ephemeral snapshot and from the
bare base model; sample ids and dedupe; snapshot semantics; external weights behind signed URLs."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from conftest import BASE, Harness

from services.auth.tenants import Tenant
from services.control.api import CheckpointRef, Done, Failed, Invalid, NotFound, SamplerRef, SaveOptions
from services.db.ids import ModelId, SamplingSessionId, SessionId
from services.domain.sampling import SampleResult, SampleWork, SamplingParams
from services.domain.training import AdamParams, Datum, ForwardBackwardWork, LoraSpec
from services.scheduler.requests import QueuedRequest, RequestKind

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, stop=())
PROMPT = np.array([5, 17, 42, 7])


def _train(h: Harness, t: Tenant, model: ModelId, first_seq: int, lr: float = 5e-2) -> None:
    rng = np.random.default_rng(first_seq)
    seq = rng.integers(0, 512, 17)
    data = [Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(16, np.float32)})]
    h.run(h.control.forward_backward(t, model, first_seq, ForwardBackwardWork(None, data)))
    h.done(t, h.run(h.control.optim_step(t, model, first_seq + 1, AdamParams(learning_rate=lr))).request_id)


def _greedy(h: Harness, t: Tenant, sampler: SamplingSessionId, seq_id: int) -> list[int]:
    sub = h.run(h.control.sample(t, sampler, seq_id, SampleWork(None, PROMPT, params=GREEDY)))
    result = h.done(t, sub.request_id)
    assert isinstance(result, SampleResult)
    return result.sequences[0].tokens


def _model(h: Harness, t: Tenant, s: SessionId) -> ModelId:
    sub = h.run(h.control.create_model(t, s, 0, BASE, LoraSpec(rank=4, seed=5, train_unembed=True), None))
    h.done(t, sub.request_id)
    return sub.model_id


def test_checkpoint_and_ephemeral_samplers(harness: Harness) -> None:
    h = harness
    t = h.tenant("acme")
    s = h.session(t)
    model = _model(h, t, s)
    _train(h, t, model, 1)
    saved = h.run(h.control.save(t, model, 3, "sampler", SaveOptions(name="s1")))
    ref = h.done(t, saved.request_id)
    assert isinstance(ref, CheckpointRef) and ref.tinker_path == f"tinker://{model}/sampler_weights/s1"

    named = h.run(h.control.create_sampling_session(t, s, 0, model_path=ref.tinker_path, base_model=None))
    assert named == f"{s}:sample:0"
    assert h.run(h.control.get_sampler(t, named)) == (BASE, ref.tinker_path)
    work = SampleWork(None, PROMPT, num_samples=3, params=SamplingParams(max_tokens=4, seed=1))
    sub = h.run(h.control.sample(t, named, 0, work))
    assert sub.sample_sequence_ids == [f"{sub.request_id}:{i}" for i in range(3)]
    again = h.run(h.control.sample(t, named, 0, work))
    assert again.request_id == sub.request_id
    result = h.done(t, sub.request_id)
    assert isinstance(result, SampleResult) and len(result.sequences) == 3

    eph = h.run(h.control.save(t, model, 4, "sampler", SaveOptions(name=None), sampling_session_seq_id=1))
    assert h.done(t, eph.request_id) == SamplerRef(SamplingSessionId(f"{s}:sample:1"))
    ephemeral = SamplingSessionId(f"{s}:sample:1")
    before = _greedy(h, t, ephemeral, 0)
    assert before == _greedy(h, t, named, 1)  # the same weights, two ways

    _train(h, t, model, 5, lr=0.5)
    assert _greedy(h, t, ephemeral, 1) == before  # a snapshot: training on does not move it
    assert _greedy(h, t, named, 2) == before
    later = h.run(h.control.save(t, model, 7, "sampler", SaveOptions(name=None), sampling_session_seq_id=3))
    h.done(t, later.request_id)
    assert _greedy(h, t, SamplingSessionId(f"{s}:sample:3"), 0) != before  # ... while the model did move

    base = h.run(h.control.create_sampling_session(t, s, 2, model_path=None, base_model=BASE))
    assert h.run(h.control.get_sampler(t, base)) == (BASE, None)
    assert len(_greedy(h, t, base, 0)) == GREEDY.max_tokens


def test_sampling_errors(harness: Harness) -> None:
    h = harness
    t = h.tenant("acme")
    s = h.session(t)
    base = h.run(h.control.create_sampling_session(t, s, 0, model_path=None, base_model=BASE))
    with pytest.raises(Invalid):
        h.run(h.control.sample(t, base, 0, SampleWork(None, np.array([1, 100_000]))))
    with pytest.raises(Invalid):
        h.run(h.control.create_sampling_session(t, s, 1, model_path="not-a-tinker-path", base_model=None))
    with pytest.raises(NotFound):
        h.run(
            h.control.create_sampling_session(
                t, s, 1, model_path="tinker://x:train:0/sampler_weights/n", base_model=None
            )
        )
    with pytest.raises(Invalid):
        h.run(h.control.create_sampling_session(t, s, 1, model_path=None, base_model="no/such-model"))


def test_external_weights_download_through_signed_urls(harness: Harness) -> None:
    h = harness
    t = h.tenant("acme")
    s = h.session(t)
    model = _model(h, t, s)
    _train(h, t, model, 1)
    saved = h.run(h.control.save(t, model, 3, "external", SaveOptions(name="export")))
    ref = h.done(t, saved.request_id)
    assert isinstance(ref, CheckpointRef) and ref.kind == "external"

    signed = h.run(h.control.external_weights_urls(t, ref.tinker_path, "http://carpool.test/"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(signed.urls)
    local = h.store.local_path(h.store.uri_for(t.id, model, "external", "export"))
    for name, url in signed.urls.items():
        assert url.startswith("http://carpool.test/api/v1/download/")
        path = h.run(h.control.open_signed_file(url.rsplit("/", 1)[1]))
        assert path.read_bytes() == (local / name).read_bytes()
    with pytest.raises(NotFound):
        h.run(h.control.open_signed_file("forged.token"))
    with pytest.raises(Invalid):
        h.run(h.control.external_weights_urls(t, f"tinker://{model}/weights/export", "http://carpool.test"))

    h.run(h.control.delete_checkpoint(t, ref.tinker_path))
    assert not local.exists()
    with pytest.raises(NotFound):
        h.run(h.control.get_checkpoint(t, ref.tinker_path))
    again = h.run(h.control.save(t, model, 4, "external", SaveOptions(name="export")))
    assert not isinstance(h.result(t, again.request_id), Failed)  # the name is free again


def test_an_idle_batched_poll_wakes_on_a_sample_submitted_here(harness: Harness,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A `retrieve_futures` poll with nothing in flight waits on the notifier for the session's submission
    bell, not on a timer: with the recheck pushed past the poll's whole hold, only the bell (and then the
    sample's completion) can make it see the sample."""
    from services.control import batch_futures

    monkeypatch.setattr(batch_futures, "RECHECK_S", 120.0)
    h = harness
    tenant = h.tenant("rl")
    sampler = h.run(h.control.create_sampling_session(tenant, h.session(tenant), 0, model_path=None, base_model=BASE))
    notifier = h.control.ctx.notifier

    async def scenario() -> tuple[list[str], str]:
        poll = asyncio.ensure_future(h.control.retrieve_futures(tenant, sampler, 0, 0, 60.0))
        while notifier.waiting() == 0:  # parked (a bound below catches a poll that never parks)
            assert not poll.done(), "the poll ended before it waited for a submission"
            await asyncio.sleep(0.01)
        work = SampleWork(None, np.array([1, 2, 3]), params=SamplingParams(max_tokens=2))
        submitted = await h.control.sample(tenant, sampler, 1, work)
        # The poll holds 30 s at most (long_poll_max_s) and then looks once more; well before that it must
        # have seen the sample, which only the bell can wake it for.
        page = await asyncio.wait_for(poll, 20.0)
        return [c.request_id for c in page.completions], submitted.request_id

    reported, request_id = h.run(asyncio.wait_for(scenario(), 40.0))
    assert reported == [request_id]


def test_a_sample_logged_but_never_queued_runs_on_the_retry(harness: Harness,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed between logging a sample and queueing it (as `make chaos` found for training
    requests): the retry of the same seq id, its row still `queued`, queues it again; the answer is the
    one request's, and a copy the scheduler already has is dropped."""
    h = harness
    t = h.tenant("acme")
    s = h.session(t)
    sampler = h.run(h.control.create_sampling_session(t, s, 0, model_path=None, base_model=BASE))
    enqueue, queued, dead = h.queue.enqueue, [], []

    def dying(base_model: str, request: QueuedRequest) -> str:
        if request.kind is RequestKind.SAMPLE and not dead:
            dead.append(request)
            raise RuntimeError("killed before queueing")
        queued.append(request.request_id)
        return enqueue(base_model, request)

    monkeypatch.setattr(h.queue, "enqueue", dying)
    work = SampleWork(None, PROMPT, params=GREEDY)
    with pytest.raises(RuntimeError):
        h.run(h.control.sample(t, sampler, 3, work))
    retry = h.run(h.control.sample(t, sampler, 3, work))
    assert retry.request_id == dead[0].request_id and queued == [retry.request_id]
    # A second copy, queued again only while the first is still queued (the loop may have run it already).
    assert h.run(h.control.sample(t, sampler, 3, work)).request_id == retry.request_id
    copies = len(queued)
    assert queued == [retry.request_id] * copies and copies in (1, 2)
    result = h.result(t, retry.request_id, timeout_s=20)
    assert isinstance(result, Done) and isinstance(result.result, SampleResult), result
    assert h.run(h.control.sample(t, sampler, 3, work)).request_id == retry.request_id
    assert len(queued) == copies  # done: not queued again


def test_a_sample_reads_its_own_session_once_and_a_foreign_or_unknown_one_every_time(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a submission needs of its sampling session never changes, so the caller's own session is read
    once per process; another tenant's session, or an unknown id, is looked up (and refused) every time."""
    from services.control.context import ControlContext

    h = harness
    owner, intruder = h.tenant("acme"), h.tenant("intruder")
    session = h.session(owner)
    sampler = h.run(h.control.create_sampling_session(owner, session, 0, model_path=None, base_model=BASE))
    unknown = SamplingSessionId(f"{session}:sample:9")
    work = SampleWork(None, PROMPT, params=GREEDY)
    h.done(owner, h.run(h.control.sample(owner, sampler, 0, work)).request_id)  # reads the session
    transactions: list[object] = []
    real_tx, real_write_tx = ControlContext.tx, ControlContext.write_tx

    async def counted(ctx: ControlContext, fn: Any) -> Any:
        transactions.append(fn)
        return await real_tx(ctx, fn)

    async def counted_write(ctx: ControlContext, fn: Any, *, caller: str = "") -> Any:
        transactions.append(fn)
        return await real_write_tx(ctx, fn, caller=caller)

    monkeypatch.setattr(ControlContext, "tx", counted)
    monkeypatch.setattr(ControlContext, "write_tx", counted_write)
    second = h.run(h.control.sample(owner, sampler, 1, work))
    assert len(transactions) == 1  # the request log alone
    for foreign in (sampler, sampler, unknown):
        with pytest.raises(NotFound):
            h.run(h.control.sample(intruder, foreign, 2, work))
    assert len(transactions) == 4  # one lookup per refused submission: nothing negative is remembered
    assert isinstance(h.done(owner, second.request_id), SampleResult)
