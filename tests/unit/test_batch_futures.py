"""`retrieve_futures` polls against a fake request log: how many transactions a held poll spends across a
sample's lifetime, and that every way a sample can finish or arrive still ends the poll; which ack polls the
memory of the last look answers without a transaction, and that it never hides a completion a look would find.

The request log is a dict (the repository functions are replaced), the notifier the in-process one, and
every `ctx.tx` is counted. Nothing here asserts on time: a poll that re-looked on a timer would show up as
extra transactions, so the timer's period is shrunk to make such a poll re-look many times."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest

from services.auth.tenants import Tenant
from services.control import batch_futures
from services.control.batch_futures import BatchFutureOps
from services.control.context import ControlContext
from services.control.submission_bell import SubmissionBell
from services.db.ids import RequestId, SamplingSessionId
from services.db.sdk_surface import Completion
from services.jobqueue import InMemoryNotifier
from services.scheduler.requests import RequestId as QueueRequestId

SESSION = SamplingSessionId("sess-1:sample:0")
TENANT = cast(Tenant, SimpleNamespace(id="tenant-1"))
HANG_S = 20.0
"""Bound for a hang only (a poll that is never woken holds 60 s); never a measurement."""


@dataclass
class FakeLog:
    """The target's requests in submission order: status and, once finished, its cursor."""

    requests: dict[str, tuple[str, int]] = field(default_factory=dict)
    looks: int = 0
    """Transactions run through the fake context."""

    def submit(self, request_id: str) -> None:
        self.requests[request_id] = ("queued", 0)

    def finish(self, request_id: str) -> None:
        self.requests[request_id] = ("done", 1 + max((c for _, c in self.requests.values()), default=0))

    def unfinished(self, limit: int) -> list[RequestId]:
        return [RequestId(r) for r, (s, _) in self.requests.items() if s != "done"][:limit]

    def completions(self, cursor: int, limit: int) -> list[Completion]:
        done = sorted((c, r) for r, (s, c) in self.requests.items() if s == "done" and c > cursor)
        return [Completion(RequestId(r), False, c) for c, r in done[:limit]]

    def look(self, db: object, sampling_id: str, clone: int, cursor: int, unfinished_limit: int, limit: int, *,
             completions_first: bool = False) -> tuple[list[RequestId], list[Completion]]:
        found = self.completions(cursor, limit)
        return ([] if completions_first and found else self.unfinished(unfinished_limit)), found


@dataclass
class Setup:
    log: FakeLog
    notifier: InMemoryNotifier
    ops: BatchFutureOps

    def poll(self, cursor: int = 0, timeout_s: float | None = 60.0) -> asyncio.Future[Any]:
        return asyncio.ensure_future(self.ops.retrieve_futures(TENANT, SESSION, 0, cursor, timeout_s))

    def finish(self, request_id: str) -> None:
        """What the scheduler loop does: the request log first, then the announcement."""
        self.log.finish(request_id)
        self.notifier.publish(QueueRequestId(request_id))

    async def parked(self, poll: asyncio.Future[Any], looks: int) -> None:
        """Until the poll has looked `looks` times and waits on the notifier."""
        while self.log.looks < looks or self.notifier.waiting() == 0:
            assert not poll.done(), "the poll ended instead of waiting"
            await asyncio.sleep(0.001)


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    log, notifier = FakeLog(), InMemoryNotifier()

    async def tx(fn: Callable[[object], Any]) -> Any:
        log.looks += 1
        return fn(None)

    # raising=False: the same test runs against a batch_futures that lacks one of them (see the report).
    monkeypatch.setattr(batch_futures, "completions_after",
                        lambda db, sid, clone, cursor, limit: log.completions(cursor, limit), raising=False)
    monkeypatch.setattr(batch_futures, "unfinished_requests",
                        lambda db, sid, clone, limit: log.unfinished(limit), raising=False)
    monkeypatch.setattr(batch_futures, "unfinished_and_completions", log.look, raising=False)
    monkeypatch.setattr(batch_futures, "RECHECK_S", 0.001)  # a poll on a timer would look very often
    ctx = SimpleNamespace(tx=tx, notifier=notifier, sample_submissions=SubmissionBell(),
                          options=SimpleNamespace(long_poll_max_s=60.0))
    ops = BatchFutureOps(cast(ControlContext, ctx))
    ops._owned.remember(TENANT.id, SESSION)  # the ownership check is not what is counted
    yield Setup(log, notifier, ops)


def reported(page: Any) -> list[str]:
    return [c.request_id for c in page.completions]


def test_a_held_poll_looks_once_when_it_starts_and_once_when_its_sample_finishes(setup: Setup) -> None:
    """Two transactions across a sample's lifetime, however long it runs (the poll used to look again every
    0.2 s, two transactions a look: about seven per 0.75 s sample)."""
    setup.log.submit("req-a")

    async def scenario() -> list[str]:
        poll = setup.poll()
        await setup.parked(poll, looks=1)
        await asyncio.sleep(0.05)  # "the sample runs": a timer-driven poll would look dozens of times here
        setup.finish("req-a")
        return reported(await asyncio.wait_for(poll, HANG_S))

    assert asyncio.run(scenario()) == ["req-a"]
    assert setup.log.looks == 2
    assert setup.notifier.waiting() == 0


def test_an_announcement_already_seen_does_not_make_the_poll_spin(setup: Setup) -> None:
    """A ring that changes nothing this target reports (say a sample of another clone) costs one look; the
    next wait is not ended at once by that same ring although the notifier still remembers it."""
    setup.log.submit("req-a")

    async def scenario() -> list[str]:
        poll = setup.poll()
        await setup.parked(poll, looks=1)
        SubmissionBell(setup.notifier).ring(SESSION)
        await setup.parked(poll, looks=2)
        await asyncio.sleep(0.05)  # a poll woken again and again by the remembered ring would look here
        assert setup.log.looks == 2
        setup.finish("req-a")
        return reported(await asyncio.wait_for(poll, HANG_S))

    assert asyncio.run(scenario()) == ["req-a"]
    assert setup.log.looks == 3


def test_a_sample_queued_through_another_gateway_wakes_a_held_poll(setup: Setup,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in flight when the poll looked; another process (its own bell, the shared notifier, as with
    Redis) queues a sample. With no timer at all, only that ring and the sample's completion end the poll."""
    monkeypatch.setattr(batch_futures, "RECHECK_S", 120.0)
    other_gateway = SubmissionBell(setup.notifier)

    async def scenario() -> list[str]:
        poll = setup.poll()
        await setup.parked(poll, looks=1)
        setup.log.submit("req-b")
        other_gateway.ring(SESSION)
        await setup.parked(poll, looks=2)  # it saw the new sample and now waits for it to finish
        setup.finish("req-b")
        return reported(await asyncio.wait_for(poll, HANG_S))

    assert asyncio.run(scenario()) == ["req-b"]
    assert setup.log.looks == 3


def test_a_sample_finished_between_the_look_and_the_wait_ends_the_poll_at_once(setup: Setup) -> None:
    """The announcement came after the poll's mark but before it waited: the wait returns at once."""
    setup.log.submit("req-a")
    notifier = setup.notifier

    async def scenario() -> list[str]:
        mark = notifier.mark()
        setup.finish("req-a")
        assert await notifier.wait_any([QueueRequestId("req-a")], 60.0, after=mark) is True
        assert await notifier.wait_any([QueueRequestId("req-a")], 0.0, after=notifier.mark()) is False
        return reported(await asyncio.wait_for(setup.poll(), HANG_S))

    assert asyncio.run(scenario()) == ["req-a"]


def test_a_sample_finished_outside_the_waited_set_is_still_reported(setup: Setup,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """More unfinished requests than `WAKE_ON`: the poll waits on the oldest, and a newer one that finishes
    first (batched sampling finishes out of order) is found by the recheck, announced or not."""
    monkeypatch.setattr(batch_futures, "WAKE_ON", 2)
    for request_id in ("req-1", "req-2", "req-3"):
        setup.log.submit(request_id)

    async def scenario() -> list[str]:
        poll = setup.poll()
        await setup.parked(poll, looks=1)
        setup.log.finish("req-3")  # not announced: only the recheck can find it
        return reported(await asyncio.wait_for(poll, HANG_S))

    assert asyncio.run(scenario()) == ["req-3"]


def test_an_ack_poll_is_one_transaction(setup: Setup) -> None:
    setup.log.submit("req-a")
    page = asyncio.run(setup.ops.retrieve_futures(TENANT, SESSION, 0, 0, 0.0))
    assert reported(page) == [] and page.cursor == 0 and setup.log.looks == 1


# --- ack polls answered from the memory of the last look --------------------------------------------------


async def held_then_acks(setup: Setup, request_id: str, acks: int = 2) -> tuple[Any, list[Any]]:
    """What the SDK does per sample: a held poll until `request_id` finishes, then `acks` ack polls with
    the cursor that poll returned."""
    poll = setup.poll()
    await setup.parked(poll, looks=setup.log.looks + 1)
    setup.finish(request_id)
    page = await asyncio.wait_for(poll, HANG_S)
    return page, [await setup.poll(page.cursor, 0.0) for _ in range(acks)]


def test_the_ack_polls_after_a_reported_completion_need_no_transaction(setup: Setup) -> None:
    """The SDK's two ack polls after each completion carry the cursor it was just given; the held poll's
    looks already showed that nothing else of the target is in flight, and nothing was announced since."""
    setup.log.submit("req-a")
    page, acks = asyncio.run(held_then_acks(setup, "req-a"))
    assert reported(page) == ["req-a"]
    assert [(reported(ack), ack.cursor) for ack in acks] == [([], page.cursor)] * 2  # the cursor stays put
    assert setup.log.looks == 2  # the held poll's two; the acks used to cost one each


def test_an_ack_poll_looks_when_a_request_it_stood_on_was_announced(setup: Setup) -> None:
    """Two samples in flight, one reported: the memory stands on the other, and its announcement sends the
    next ack poll to the database, which reports it exactly as a look always did."""
    setup.log.submit("req-a")
    setup.log.submit("req-b")

    async def scenario() -> tuple[Any, Any, Any]:
        page, [quiet] = await held_then_acks(setup, "req-a", acks=1)
        looks = setup.log.looks
        setup.finish("req-b")
        late = await setup.poll(page.cursor, 0.0)
        assert setup.log.looks == looks + 1
        return page, quiet, late

    page, quiet, late = asyncio.run(scenario())
    assert reported(page) == ["req-a"] and reported(quiet) == [] and quiet.cursor == page.cursor
    assert reported(late) == ["req-b"] and late.cursor > page.cursor


def test_a_sample_queued_since_the_look_sends_the_ack_poll_to_the_database(setup: Setup) -> None:
    """A sample queued (through any gateway: the bell rings through the notifier) after the last look is
    not in its memory: the next ack poll looks, and reports the sample if it already finished."""
    setup.log.submit("req-a")

    async def scenario() -> list[tuple[list[str], int]]:
        page, _ = await held_then_acks(setup, "req-a", acks=1)
        setup.log.submit("req-b")
        SubmissionBell(setup.notifier).ring(SESSION)
        setup.finish("req-b")
        answers = [await setup.poll(page.cursor, 0.0)]
        answers += [await setup.poll(answers[-1].cursor, 0.0) for _ in range(3)]
        return [(reported(a), a.cursor) for a in answers]

    (first, cursor), *rest = asyncio.run(scenario())
    assert first == ["req-b"] and rest == [([], cursor)] * 3
    assert setup.log.looks == 2 + 1 + 1  # held poll, the ack that found req-b, one more to learn anew


def test_an_ack_poll_with_another_cursor_looks(setup: Setup) -> None:
    """A new poller of the same target starts at cursor 0: the memory only answers for its own cursor."""
    setup.log.submit("req-a")

    async def scenario() -> Any:
        await held_then_acks(setup, "req-a", acks=1)
        return await setup.poll(0, 0.0)

    assert reported(asyncio.run(scenario())) == ["req-a"]
    assert setup.log.looks == 3


def test_a_finish_never_announced_is_reported_once_the_memory_is_old(setup: Setup) -> None:
    """A scheduler process that dies between its commit and its announcement: held polls look at the
    database first, and an ack poll trusts a look for `MEMORY_S` at most."""
    now = [0.0]
    setup.ops._memory = batch_futures.LookMemory(clock=lambda: now[0])
    setup.log.submit("req-a")

    async def scenario() -> tuple[Any, Any, Any]:
        page, _ = await held_then_acks(setup, "req-a", acks=1)
        setup.log.submit("req-b")  # queued (and rung) before the look
        SubmissionBell(setup.notifier).ring(SESSION)
        learned = await setup.poll(page.cursor, 0.0)  # looks: the bell rang; it learns that req-b runs
        setup.log.finish("req-b")  # never announced
        trusted = await setup.poll(page.cursor, 0.0)
        now[0] += batch_futures.MEMORY_S
        return learned, trusted, await setup.poll(page.cursor, 0.0)

    learned, trusted, late = asyncio.run(scenario())
    assert reported(learned) == [] and reported(trusted) == [] and reported(late) == ["req-b"]


def test_a_look_at_more_unfinished_requests_than_the_memory_keeps_is_not_remembered(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_futures, "MEMORY_WATCH", 1)
    setup.log.submit("req-a")
    setup.log.submit("req-b")

    async def scenario() -> list[Any]:
        return [await setup.poll(0, 0.0) for _ in range(3)]

    assert [(reported(a), a.cursor) for a in asyncio.run(scenario())] == [([], 0)] * 3
    assert setup.log.looks == 3


def test_the_memory_keeps_the_most_recently_used_targets() -> None:
    notifier = InMemoryNotifier()
    memory = batch_futures.LookMemory(capacity=2)
    bell = QueueRequestId("bell")
    quiet = batch_futures.Look(notifier.mark(), [], [])
    for clone in range(3):
        memory.learn((SESSION, clone), 0, quiet, bell)
        if clone == 1:
            assert memory.quiet((SESSION, 0), 0, notifier)  # target 0 is now the most recently used
    assert len(memory) == 2
    assert [memory.quiet((SESSION, clone), 0, notifier) for clone in range(3)] == [True, False, True]
    notifier.publish(bell)
    assert not memory.quiet((SESSION, 0), 0, notifier)
