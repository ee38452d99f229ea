"""`OwnedIds`, the memory that spares per-step ownership lookups (models, sampling sessions): only positives,
bounded."""

from __future__ import annotations

import threading

import pytest

from services.control.ownership import OwnedIds


def test_only_remembered_pairs_are_known() -> None:
    owned = OwnedIds()
    owned.remember("tenant-a", "model-1")
    assert owned.known("tenant-a", "model-1")
    assert not owned.known("tenant-b", "model-1")  # another tenant with A's model id: look it up
    assert not owned.known("tenant-a", "model-2")


def test_least_recently_used_pair_goes_first() -> None:
    owned = OwnedIds(capacity=2)
    owned.remember("t", "m1")
    owned.remember("t", "m2")
    assert owned.known("t", "m1")  # m1 is now the most recently used
    owned.remember("t", "m3")
    assert owned.known("t", "m1") and owned.known("t", "m3") and not owned.known("t", "m2")
    assert len(owned) == 2


def test_capacity_zero_remembers_nothing() -> None:
    owned = OwnedIds(capacity=0)
    owned.remember("t", "m")
    assert not owned.known("t", "m") and len(owned) == 0
    with pytest.raises(ValueError, match="capacity"):
        OwnedIds(capacity=-1)


def test_threads_remember_and_read_concurrently() -> None:
    owned = OwnedIds(capacity=500)

    def work(n: int) -> None:
        for i in range(1000):
            owned.remember(f"t{n}", f"m{i}")
            owned.known(f"t{n}", f"m{i // 2}")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(owned) == 500
