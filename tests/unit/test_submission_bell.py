"""`SubmissionBell`: a ring wakes the polls waiting on its key, only them, and only those already waiting."""

from __future__ import annotations

import asyncio

from services.control.submission_bell import SubmissionBell


def test_a_ring_wakes_the_waiters_of_its_key_only() -> None:
    bell = SubmissionBell()

    async def scenario() -> list[bool]:
        waits = [asyncio.ensure_future(bell.wait(key, 0.5)) for key in ("s1", "s1", "s2")]
        while bell.waiting() < 3:
            await asyncio.sleep(0)
        bell.ring("s1")
        return list(await asyncio.gather(*waits))

    assert asyncio.run(scenario()) == [True, True, False]
    assert bell.waiting() == 0


def test_a_ring_before_the_wait_is_not_remembered() -> None:
    bell = SubmissionBell()
    bell.ring("s1")  # nobody waiting: the next poll looks at the database first anyway
    assert asyncio.run(bell.wait("s1", 0.05)) is False
    assert bell.waiting() == 0
