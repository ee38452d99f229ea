"""UnrecordedBacklog: items whose bookkeeping failed are retried oldest first, with backoff, and bounded."""

from __future__ import annotations

import pytest

from services.runtime.unrecorded import UnrecordedBacklog, UnrecordedItem


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _item(name: str) -> UnrecordedItem:
    return UnrecordedItem((), name, (f"{name}-entry",))


def test_items_are_retried_oldest_first_after_the_retry_interval() -> None:
    clock = Clock()
    backlog = UnrecordedBacklog(retry_s=5.0, clock=clock)
    assert not backlog.due()
    backlog.add(_item("a"))
    backlog.add(_item("b"))
    assert not backlog.due()
    clock.now += 5.0
    assert backlog.due()
    seen: list[str | None] = []
    recorded = backlog.retry(lambda item: seen.append(item.pass_id))
    assert seen == ["a", "b"] and [i.pass_id for i in recorded] == ["a", "b"] and len(backlog) == 0
    assert not backlog.due()


def test_a_failing_retry_stops_at_the_failing_item_and_backs_off_to_the_cap() -> None:
    clock = Clock()
    backlog = UnrecordedBacklog(retry_s=5.0, max_retry_s=12.0, clock=clock)
    for name in "abc":
        backlog.add(_item(name))

    def fail_on_b(item: UnrecordedItem) -> None:
        if item.pass_id == "b":
            raise RuntimeError("database unreachable")

    clock.now += 5.0
    assert [i.pass_id for i in backlog.retry(fail_on_b)] == ["a"]
    assert len(backlog) == 2
    delays = []
    for _ in range(3):
        start = clock.now
        while not backlog.due():
            clock.now += 1.0
        delays.append(clock.now - start)
        backlog.retry(fail_on_b)
    assert delays == [5.0, 10.0, 12.0]
    clock.now += 12.0
    assert [i.pass_id for i in backlog.retry(lambda item: None)] == ["b", "c"]

    backlog.add(_item("d"))  # a fresh outage starts from the first interval again
    clock.now += 4.0
    assert not backlog.due()
    clock.now += 1.0
    assert backlog.due()


def test_past_the_limit_the_oldest_items_are_handed_back_for_acknowledgement() -> None:
    backlog = UnrecordedBacklog(limit=2, clock=Clock())
    assert backlog.add(_item("a")) == [] and backlog.add(_item("b")) == []
    dropped = backlog.add(_item("c"))
    assert [i.delivery_ids for i in dropped] == [("a-entry",)] and len(backlog) == 2


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="limit"):
        UnrecordedBacklog(limit=0)
