"""`AcceptedRequests`: the bounded, expiring map of requests accepted here whose result is not collected."""

from __future__ import annotations

from services.control.pending import AcceptedRequests


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_remembers_owner_and_kind_until_discarded() -> None:
    accepted = AcceptedRequests(clock=Clock())
    accepted.add("r1", "tenant-a", "forward_backward")
    entry = accepted.get("r1")
    assert entry is not None and (entry.tenant_id, entry.kind) == ("tenant-a", "forward_backward")
    assert accepted.get("r2") is None
    accepted.discard("r1")
    accepted.discard("r1")  # idempotent
    assert accepted.get("r1") is None and len(accepted) == 0


def test_entries_expire_after_max_age() -> None:
    clock = Clock()
    accepted = AcceptedRequests(max_age_s=10.0, clock=clock)
    accepted.add("old", "t", "optim_step")
    clock.now += 6
    accepted.add("young", "t", "optim_step")
    clock.now += 5
    assert accepted.get("old") is None and accepted.get("young") is not None
    accepted.add("another", "t", "sample")  # adding trims what expired
    assert len(accepted) == 2


def test_size_is_bounded_oldest_first() -> None:
    accepted = AcceptedRequests(max_entries=3, clock=Clock())
    for i in range(5):
        accepted.add(f"r{i}", "t", "forward")
    assert len(accepted) == 3
    assert [accepted.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
