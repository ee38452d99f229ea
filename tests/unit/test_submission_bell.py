"""`SubmissionBell`: a ring announces its session's key on the notifier, wakes the polls waiting on that key
only, and counts for a poll only when rung after the poll's mark."""

from __future__ import annotations

import asyncio

from services.control.submission_bell import SubmissionBell
from services.jobqueue import InMemoryNotifier
from services.scheduler.requests import RequestId


def key(session: str) -> RequestId:
    return RequestId(SubmissionBell.key(session))


def test_a_ring_wakes_the_waiters_of_its_key_only() -> None:
    notifier = InMemoryNotifier()
    bell = SubmissionBell(notifier)

    async def scenario() -> list[bool]:
        mark = notifier.mark()
        waits = [asyncio.ensure_future(notifier.wait_any([key(s)], 0.5, after=mark)) for s in ("s1", "s1", "s2")]
        while notifier.waiting() < 3:
            await asyncio.sleep(0)
        bell.ring("s1")
        return list(await asyncio.gather(*waits))

    assert asyncio.run(scenario()) == [True, True, False]
    assert notifier.waiting() == 0


def test_a_ring_before_the_mark_does_not_count_and_one_after_it_does() -> None:
    notifier = InMemoryNotifier()
    bell = SubmissionBell(notifier)
    bell.ring("s1")  # seen by the poll's look already

    async def scenario() -> tuple[bool, bool]:
        mark = notifier.mark()
        before = await notifier.wait_any([key("s1")], 0.05, after=mark)
        bell.ring("s1")  # after the mark, before the wait: the wait must not miss it
        return before, await notifier.wait_any([key("s1")], 60.0, after=mark)

    assert asyncio.run(scenario()) == (False, True)


def test_a_bell_rings_nowhere_without_a_notifier_and_its_keys_are_not_request_ids() -> None:
    notifier = InMemoryNotifier()
    bell = SubmissionBell()
    mark = notifier.mark()
    bell.ring("s1")
    assert notifier.mark() == mark
    bell = SubmissionBell(notifier)
    bell.ring("s1")
    assert notifier.mark() > mark
    assert not SubmissionBell.key("s1").startswith("req-")
