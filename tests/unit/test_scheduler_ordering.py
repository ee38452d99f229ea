"""Per-model seq_id sequencing: out-of-order chunks, retries, consumed gaps, stale ids, sample dedupe."""

from __future__ import annotations

import pytest

from services.scheduler.ordering import Sequencer, StaleSeqIdError, UnorderedDedupe
from services.scheduler.requests import ModelId, QueuedRequest, RequestId, RequestKind, TenantId

MODEL = ModelId("sess-1:train:0")


def req(
    seq: int,
    *,
    model: ModelId = MODEL,
    rid: str | None = None,
    kind: RequestKind = RequestKind.FORWARD_BACKWARD,
) -> QueuedRequest:
    return QueuedRequest(
        request_id=RequestId(rid or f"{model}/{seq}"),
        tenant_id=TenantId("t1"),
        model_id=model,
        kind=kind,
        seq_id=seq,
        num_tokens=8,
    )


def seqs(requests: list[QueuedRequest]) -> list[int | None]:
    return [r.seq_id for r in requests]


def test_in_order_arrivals_are_released_immediately() -> None:
    sequencer = Sequencer()
    for seq in (0, 1, 2):
        assert sequencer.submit(req(seq)) == (RequestId(f"{MODEL}/{seq}"), True)
    assert seqs(sequencer.ready(MODEL)) == [0, 1, 2]
    assert sequencer.ready(MODEL) == []
    assert sequencer.next_seq_id(MODEL) == 3


def test_chunks_two_to_n_before_one_wait_for_chunk_one() -> None:
    sequencer = Sequencer()
    sequencer.open(MODEL, next_seq_id=1)
    for seq in (4, 2, 3):
        sequencer.submit(req(seq))
    assert sequencer.ready(MODEL) == []
    assert sorted(seqs(list(sequencer.waiting()))) == [2, 3, 4]
    sequencer.submit(req(1))
    assert seqs(sequencer.ready(MODEL)) == [1, 2, 3, 4]
    assert list(sequencer.waiting()) == []


def test_unknown_model_starts_at_seq_zero() -> None:
    sequencer = Sequencer()
    sequencer.submit(req(1))
    assert sequencer.ready(MODEL) == []
    sequencer.submit(req(0, kind=RequestKind.CREATE))
    assert seqs(sequencer.ready(MODEL)) == [0, 1]


def test_duplicate_maps_to_the_existing_request_id_whether_pending_or_released() -> None:
    sequencer = Sequencer()
    sequencer.open(MODEL, next_seq_id=1)
    assert sequencer.submit(req(2, rid="first")) == ("first", True)
    assert sequencer.submit(req(2, rid="retry")) == ("first", False)
    sequencer.submit(req(1))
    assert seqs(sequencer.ready(MODEL)) == [1, 2]
    assert sequencer.submit(req(2, rid="late-retry")) == ("first", False)
    assert sequencer.ready(MODEL) == []
    assert sequencer.known(MODEL, 2) == "first"


def test_consumed_seq_id_does_not_block_the_model() -> None:
    sequencer = Sequencer()
    sequencer.open(MODEL, next_seq_id=1)
    sequencer.submit(req(2))
    sequencer.submit(req(3))
    assert sequencer.mark_consumed(MODEL, 1) is True
    assert seqs(sequencer.ready(MODEL)) == [2, 3]


def test_consumed_ahead_of_the_position_is_skipped_when_reached() -> None:
    sequencer = Sequencer()
    sequencer.open(MODEL, next_seq_id=1)
    assert sequencer.mark_consumed(MODEL, 2, RequestId("rejected-2")) is True
    sequencer.submit(req(1))
    sequencer.submit(req(3))
    assert seqs(sequencer.ready(MODEL)) == [1, 3]
    # A retry of the rejected submission maps onto the id whose error result the gateway stored.
    assert sequencer.submit(req(2, rid="retry")) == ("rejected-2", False)


def test_mark_consumed_of_a_submitted_seq_id_changes_nothing() -> None:
    sequencer = Sequencer()
    sequencer.open(MODEL, next_seq_id=1)
    sequencer.submit(req(2))
    assert sequencer.mark_consumed(MODEL, 2) is False
    sequencer.submit(req(1))
    assert seqs(sequencer.ready(MODEL)) == [1, 2]


def test_consumed_seq_id_without_request_id_cannot_be_resubmitted() -> None:
    sequencer = Sequencer()
    sequencer.open(MODEL, next_seq_id=1)
    sequencer.mark_consumed(MODEL, 1)
    with pytest.raises(StaleSeqIdError):
        sequencer.submit(req(1))


def test_seq_id_behind_the_dedupe_window_is_stale() -> None:
    sequencer = Sequencer(dedupe_window=2)
    for seq in range(5):
        sequencer.submit(req(seq))
    sequencer.ready(MODEL)
    assert sequencer.submit(req(4, rid="x")) == (f"{MODEL}/4", False)
    assert sequencer.known(MODEL, 1) is None
    with pytest.raises(StaleSeqIdError):
        sequencer.submit(req(1, rid="x"))


def test_models_are_sequenced_independently() -> None:
    other = ModelId("sess-2:train:0")
    sequencer = Sequencer()
    sequencer.open(MODEL, next_seq_id=1)
    sequencer.open(other, next_seq_id=1)
    sequencer.submit(req(2))
    sequencer.submit(req(1, model=other))
    assert [(r.model_id, r.seq_id) for r in sequencer.drain()] == [(other, 1)]


def test_open_after_recovery_resumes_at_the_given_position() -> None:
    sequencer = Sequencer()
    sequencer.open(MODEL, next_seq_id=57)
    sequencer.submit(req(57))
    assert seqs(sequencer.ready(MODEL)) == [57]
    sequencer.open(MODEL, next_seq_id=3)  # an open model keeps its position
    assert sequencer.next_seq_id(MODEL) == 58


def test_forget_returns_everything_still_waiting() -> None:
    sequencer = Sequencer()
    sequencer.open(MODEL, next_seq_id=1)
    sequencer.submit(req(1))
    sequencer.submit(req(3))
    assert seqs(sequencer.forget(MODEL)) == [1, 3]
    assert sequencer.next_seq_id(MODEL) == 0


def test_unordered_dedupe_by_session_and_seq_id() -> None:
    dedupe = UnorderedDedupe(capacity=2)

    def sample(session: str, seq: int | None, rid: str) -> QueuedRequest:
        return QueuedRequest(RequestId(rid), TenantId("t"), ModelId(session), RequestKind.SAMPLE, seq)

    assert dedupe.admit(sample("s1", 1, "a")) == ("a", True)
    assert dedupe.admit(sample("s1", 1, "b")) == ("a", False)
    assert dedupe.admit(sample("s2", 1, "c")) == ("c", True)
    assert dedupe.admit(sample("s1", None, "d")) == ("d", True)
    assert dedupe.admit(sample("s1", None, "e")) == ("e", True)
    dedupe.admit(sample("s3", 1, "f"))  # evicts the oldest key (s1, 1)
    assert dedupe.admit(sample("s1", 1, "g")) == ("g", True)


def test_drain_and_waiting_visit_only_models_with_something_to_hand_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # The loop drains (and counts early arrivals) every iteration; with hundreds of idle models that must
    # not cost a visit to each of them.
    sequencer = Sequencer()
    models = [ModelId(f"m{i}") for i in range(500)]
    for model in models:
        sequencer.submit(req(0, model=model))
    assert len(list(sequencer.drain())) == 500  # every model now idle
    visited: list[ModelId] = []
    original = Sequencer.ready

    def counting_ready(self: Sequencer, model_id: ModelId) -> list[QueuedRequest]:
        visited.append(model_id)
        return original(self, model_id)

    monkeypatch.setattr(Sequencer, "ready", counting_ready)
    sequencer.submit(req(1, model=models[7]))
    sequencer.submit(req(1, model=models[3]))
    sequencer.submit(req(2, model=models[5]))  # early: seq 1 missing
    assert [(r.model_id, r.seq_id) for r in sequencer.drain()] == [(models[3], 1), (models[7], 1)]  # open order
    assert sorted(visited) == [models[3], models[7]]
    assert [(r.model_id, r.seq_id) for r in sequencer.waiting()] == [(models[5], 2)]
    sequencer.submit(req(1, model=models[5]))
    assert list(sequencer.waiting()) == [] and seqs(list(sequencer.drain())) == [1, 2]
    sequencer.submit(req(4, model=models[9]))
    sequencer.forget(models[9])
    assert list(sequencer.waiting()) == [] and list(sequencer.drain()) == []
