"""`ReplicaPool`: the `Backend` a cluster scheduler drives, spread over the worker replicas of one base model.

    SchedulerLoop ─▶ Dispatcher ─▶ ReplicaPool.forward_backward(works of many tenants)
                                      │ split by the replica each adapter lives on
                                      ├─▶ replica 1: PassCall(its tenants' works)  ┐ in parallel, each still
                                      └─▶ replica 2: PassCall(its tenants' works)  ┘ one packed pass
    barriers (optim_step, save, load) and samples go to the replica of their adapter

Placement: a new adapter goes to the live replica holding the fewest adapters and stays there; the map is
kept in Redis (`journal.PlacementStore`) so a scheduler that takes over finds it.

Durability and fail-over: every adapter-changing call is logged before dispatch (`journal`), and every
`snapshot_every_steps` optimizer steps the replica snapshots the adapter, which clears its log. When a
replica dies (its heartbeat lapses, noticed by a call or by the periodic membership check), each of its
adapters is rebuilt on a live replica from snapshot + log (`RestoreCall`), and the interrupted calls are
sent again: the restore already applied the logged ones, so the replica answers those from memory. A
client sees a delay, never a lost or doubled step.

Request ids. The `Backend` interface carries work, not request ids, yet the replicas need them: to answer
a repeated request from memory instead of applying it twice (after a scheduler fail-over) and to key the
durability log. The loop calls its completion hook's `started(requests, ...)` on the loop thread just
before it dispatches those requests, so `TrackingHook` records them in the pool's `DispatchContext`,
which tells each work object (`ForwardBackward.work`, by identity) or barrier its request. Without the
hook the pool still works; it only loses exactly-once across scheduler fail-overs.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from services.domain.backend import BaseModelInfo
from services.domain.sampling import SampleResult, SampleWork
from services.domain.training import (
    AdamParams,
    AdapterId,
    ForwardBackwardResult,
    ForwardBackwardWork,
    LoraSpec,
    OptimStepResult,
    WorkError,
)
from services.runtime.commands import ForwardBackward
from services.runtime.journal import DurabilityJournal, PlacementStore
from services.runtime.replica_protocol import (
    CopyCall,
    CreateCall,
    DropCall,
    LoadCall,
    OptimCall,
    OptimEntry,
    PassCall,
    PassEntry,
    ReplicaCall,
    ReplicaCallError,
    ReplicaGone,
    ReplicaLink,
    RequestTag,
    RestoreCall,
    SampleCall,
    SaveCall,
    SnapshotOrder,
)
from services.runtime.reporting import CompletionHook, StoreResults
from services.scheduler.requests import Completion, QueuedRequest
from services.storage import safe_component

log = logging.getLogger(__name__)

Indexed = list[tuple[int, object]]
"""(position in the caller's list, item) pairs of one sub-call."""


@dataclass(frozen=True)
class PoolConfig:
    snapshot_dir: Path
    """Shared by scheduler and replicas (a volume or bucket mount): snapshots are written and read there."""
    snapshot_every_steps: int = 5
    """Optimizer steps per adapter between snapshots; the log holds at most this many steps of work."""
    replica_wait_s: float = 120.0
    """How long a call waits for a live replica (at start-up, or while every replica restarts)."""
    membership_check_s: float = 1.0
    """How often the heartbeats of replicas holding adapters are checked between calls."""
    max_failovers_per_call: int = 3
    parallel_calls: int = 8


class ReplicaPool:
    """Implements `services.domain.backend.Backend` (plus `copy_adapter`) over a `ReplicaLink`."""

    def __init__(self, base_model: str, link: ReplicaLink, placement: PlacementStore, journal: DurabilityJournal,
                 config: PoolConfig, *, fence: Callable[[], int] = lambda: 0) -> None:
        self.base_model = base_model
        self.context = DispatchContext()
        self.failovers = 0
        self.restores = 0
        self._link = link
        self._placement = placement
        self._journal = journal
        self._config = config
        self._fence = fence
        self._where = placement.load()
        self._optims: dict[str, int] = {}
        self._dead: set[str] = set()
        self._lock = threading.RLock()
        self._checked_at = 0.0
        self._threads = ThreadPoolExecutor(max_workers=config.parallel_calls, thread_name_prefix="pool-call")

    # -- Backend ---------------------------------------------------------------------------------------
    @property
    def info(self) -> BaseModelInfo:
        published = self._link.published_model()
        if published is None:
            raise ReplicaCallError(f"no worker of {self.base_model} has published its model yet")
        return published.info

    def placement(self) -> dict[str, str]:
        """A copy of adapter → replica (for metrics and tests)."""
        with self._lock:
            return dict(self._where)

    def has_adapter(self, adapter_id: AdapterId) -> bool:
        with self._lock:
            return adapter_id in self._where

    def create_adapter(self, adapter_id: AdapterId, spec: LoraSpec) -> None:
        order, request_id = self._new_order(adapter_id), self.context.barrier()
        self._call_on(adapter_id, CreateCall(request_id, adapter_id, spec, order), place=True)
        self._committed(adapter_id, order, request_id, None)

    def load_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> LoraSpec:
        order, request_id = self._new_order(adapter_id), self.context.barrier()
        call = LoadCall(request_id, adapter_id, str(path), with_optimizer, order)
        spec = self._call_on(adapter_id, call, place=True)
        self._committed(adapter_id, order, request_id, spec)
        assert isinstance(spec, LoraSpec)
        return spec

    def copy_adapter(self, source: AdapterId, target: AdapterId) -> None:
        """`target` becomes a weights-only copy of `source`, resident on the same replica."""
        order, request_id = self._new_order(target), self.context.barrier()
        self._call_on(target, CopyCall(request_id, source, target, order), place=True, near=source)
        self._committed(target, order, request_id, None)

    def drop_adapter(self, adapter_id: AdapterId) -> None:
        if self.has_adapter(adapter_id):
            self._call_on(adapter_id, DropCall(adapter_id))
        with self._lock:
            self._where.pop(adapter_id, None)
        self._placement.remove(adapter_id)
        self._journal.forget(adapter_id)

    def save_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> int:
        size = self._call_on(adapter_id, SaveCall(adapter_id, str(path), with_optimizer))
        assert isinstance(size, int)
        return size

    def save_encrypted_adapter(self, adapter_id: AdapterId, path: Path, *, recipients: tuple[str, ...]) -> int:
        """An age-encrypted export, encrypted by the replica that holds the adapter (before any upload)."""
        size = self._call_on(adapter_id, SaveCall(adapter_id, str(path), False, tuple(recipients)))
        assert isinstance(size, int)
        return size

    def optim_step(self, adapter_id: AdapterId, params: AdamParams) -> OptimStepResult:
        request_id = self.context.barrier()
        if not self.has_adapter(adapter_id):  # the replica answers "unknown adapter"; nothing to log
            return self._call_on(adapter_id, OptimCall(request_id, adapter_id, params))  # type: ignore[return-value]
        steps = self._optims_since_snapshot(adapter_id) + 1
        order = self._new_order(adapter_id) if steps >= self._config.snapshot_every_steps else None
        self._journal.append([(adapter_id, OptimEntry(request_id, params))])
        result = self._call_on(adapter_id, OptimCall(request_id, adapter_id, params, order))
        if order is not None:
            self._committed(adapter_id, order, request_id, result)
        else:
            self._optims[adapter_id] = steps
        assert isinstance(result, OptimStepResult)
        return result

    def forward_backward(self, works: Sequence[ForwardBackwardWork]) -> list[ForwardBackwardResult | WorkError]:
        items = [(self.context.request_of(work), work) for work in works]
        self._check_membership()
        self._log_pass(items)
        results = self._spread(list(enumerate(items)), self._pass_target, _pass_call)
        return results  # type: ignore[return-value]

    def sample(self, works: Sequence[SampleWork]) -> list[SampleResult | WorkError]:
        self._check_membership()
        results = self._spread(list(enumerate(works)), lambda w: self._route(w.adapter_id), _sample_call)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    # -- routing -----------------------------------------------------------------------------------------
    def _call_on(self, adapter_id: AdapterId, call: ReplicaCall, *, place: bool = False,
                 near: AdapterId | None = None) -> object:
        """Run a call on the adapter's replica (placing the adapter first if asked), failing over as needed."""
        for _ in range(self._config.max_failovers_per_call + 1):
            replica = self._route(near if near is not None else adapter_id)
            if place:
                self._place(adapter_id, replica)
            try:
                return self._link.call(replica, call, self._fence())
            except ReplicaGone as gone:
                self._fail_over(gone.replica_id)
        raise ReplicaCallError(f"{type(call).__name__} of {adapter_id} failed over too often; giving up")

    def _spread(self, indexed: Indexed, target: Callable[[object], str],
                make_call: Callable[[list[object]], ReplicaCall]) -> list[object]:
        """Split items by replica, run the sub-calls in parallel, put the answers back in order."""
        results: list[object] = [None] * len(indexed)
        pending = indexed
        for _ in range(self._config.max_failovers_per_call + 1):
            groups: dict[str, Indexed] = {}
            for position, item in pending:
                groups.setdefault(target(item), []).append((position, item))
            pending = []
            for replica, group, outcome in self._run_groups(groups, make_call):
                if isinstance(outcome, ReplicaGone):
                    self._fail_over(replica)
                    pending += group
                    continue
                for (position, _), value in zip(group, outcome, strict=True):
                    results[position] = value
            if not pending:
                return results
        raise ReplicaCallError("a pass failed over too often; giving up")

    def _run_groups(self, groups: dict[str, Indexed], make_call: Callable[[list[object]], ReplicaCall]
                    ) -> list[tuple[str, Indexed, list[object] | ReplicaGone]]:
        def run(replica: str, group: Indexed) -> list[object] | ReplicaGone:
            try:
                answer = self._link.call(replica, make_call([item for _, item in group]), self._fence())
            except ReplicaGone as gone:
                return gone
            assert isinstance(answer, list)
            return answer

        if len(groups) == 1:  # the common single-replica case needs no thread hop
            (replica, group), = groups.items()
            return [(replica, group, run(replica, group))]
        futures = {replica: self._threads.submit(run, replica, group) for replica, group in groups.items()}
        return [(replica, groups[replica], future.result()) for replica, future in futures.items()]

    def _pass_target(self, item: object) -> str:
        _, work = item  # type: ignore[misc]
        return self._route(work.adapter_id)

    def _route(self, adapter_id: str | None) -> str:
        """The adapter's replica; an unknown adapter (or the base model) goes to the least-loaded one."""
        with self._lock:
            replica = self._where.get(adapter_id) if adapter_id is not None else None
            if replica is not None and replica not in self._dead:
                return replica
        return self._least_loaded()

    def _place(self, adapter_id: str, replica: str) -> None:
        with self._lock:
            if self._where.get(adapter_id) == replica:
                return
            self._where[adapter_id] = replica
        self._placement.place(adapter_id, replica)

    def _least_loaded(self) -> str:
        deadline = time.monotonic() + self._config.replica_wait_s
        while True:
            live = [r for r in self._link.live_replicas() if r not in self._dead]
            if live:
                with self._lock:
                    load = {r: 0 for r in live}
                    for replica in self._where.values():
                        if replica in load:
                            load[replica] += 1
                return min(live, key=lambda r: (load[r], r))
            if time.monotonic() > deadline:
                raise ReplicaCallError(f"no live replica of {self.base_model} for {self._config.replica_wait_s:.0f} s")
            time.sleep(0.2)

    # -- durability ---------------------------------------------------------------------------------------
    def _log_pass(self, items: list[tuple[RequestTag, ForwardBackwardWork]]) -> None:
        by_adapter: dict[str, list[tuple[RequestTag, ForwardBackwardWork]]] = {}
        for request_id, work in items:
            if work.adapter_id is not None and not work.forward_only and self.has_adapter(work.adapter_id):
                by_adapter.setdefault(work.adapter_id, []).append((request_id, work))
        self._journal.append((a, PassEntry(tuple(group))) for a, group in by_adapter.items())

    def _new_order(self, adapter_id: str) -> SnapshotOrder:
        folder = self._config.snapshot_dir / safe_component(self.base_model) / safe_component(adapter_id)
        current = self._journal.snapshot(adapter_id)
        return SnapshotOrder(str(folder / uuid.uuid4().hex[:12]), current.previous if current else None)

    def _committed(self, adapter_id: str, order: SnapshotOrder, request_id: RequestTag, result: object) -> None:
        """Point at the snapshot `order` wrote; it contains `request_id`'s call, whose result the pointer keeps
        (journal docstring: the scheduler-and-replica double-apply window)."""
        applied = {request_id: result} if request_id is not None else None
        self._journal.commit_snapshot(adapter_id, order.path, applied)
        self._optims[adapter_id] = 0

    def _optims_since_snapshot(self, adapter_id: str) -> int:
        if adapter_id not in self._optims:  # first touch since this pool started: count the log
            entries = self._journal.entries(adapter_id)
            self._optims[adapter_id] = sum(isinstance(e, OptimEntry) for e in entries)
        return self._optims[adapter_id]

    # -- fail-over ----------------------------------------------------------------------------------------
    def _check_membership(self) -> None:
        """Fail over replicas that hold adapters but stopped beating, even if no call noticed yet."""
        if time.monotonic() - self._checked_at < self._config.membership_check_s:
            return
        self._checked_at = time.monotonic()
        with self._lock:
            holding = {r for r in self._where.values() if r not in self._dead}
        for replica in sorted(holding):
            if not self._link.alive(replica):
                self._fail_over(replica)

    def _fail_over(self, replica: str) -> None:
        with self._lock:
            if replica in self._dead:
                return
            self._dead.add(replica)
            self.failovers += 1
            adapters = sorted(a for a, r in self._where.items() if r == replica)
            log.warning("%s: replica %s is gone; restoring its %d adapters elsewhere", self.base_model, replica,
                        len(adapters))
            self._link.forget(replica)
            for adapter_id in adapters:
                self._restore(adapter_id)

    def _restore(self, adapter_id: str) -> None:
        """Rebuild one adapter of a dead replica on the least-loaded live one (lock held)."""
        pointer = self._journal.snapshot(adapter_id)
        if pointer is None:  # it died while being created: the retried creation places it afresh
            self._where.pop(adapter_id, None)
            self._placement.remove(adapter_id)
            return
        entries = tuple(self._journal.entries(adapter_id))
        target = self._least_loaded()
        self._place(adapter_id, target)
        try:
            restore = RestoreCall(AdapterId(adapter_id), pointer.path, entries, tuple(pointer.applied.items()))
            self._link.call(target, restore, self._fence())
        except ReplicaGone as gone:
            self._fail_over(gone.replica_id)  # moves this adapter on again, with the target's others
            return
        self._optims[adapter_id] = sum(isinstance(e, OptimEntry) for e in entries)
        self.restores += 1
        log.info("%s: %s restored on %s (%d logged calls replayed)", self.base_model, adapter_id, target,
                 len(entries))


def _pass_call(items: list[object]) -> ReplicaCall:
    return PassCall(tuple(items))  # type: ignore[arg-type]


def _sample_call(works: list[object]) -> ReplicaCall:
    return SampleCall(tuple(works))  # type: ignore[arg-type]


class DispatchContext:
    """The request ids of the plan item being dispatched. Written and read on the loop thread only."""

    def __init__(self) -> None:
        self._by_work: dict[int, str] = {}
        self._barrier: str | None = None

    def started(self, requests: Sequence[QueuedRequest]) -> None:
        by_work: dict[int, str] = {}
        barrier = None
        for request in requests:
            if isinstance(request.payload, ForwardBackward):
                # The dispatcher hands the backend these very objects; identity is the join key.
                by_work[id(request.payload.work)] = request.request_id
            elif request.kind.is_barrier:
                barrier = request.request_id
        self._by_work, self._barrier = by_work, barrier

    def request_of(self, work: object) -> str | None:
        return self._by_work.get(id(work))

    def barrier(self) -> str | None:
        return self._barrier


class TrackingHook:
    """A `CompletionHook` that tells a `DispatchContext` what starts, then delegates to `inner`."""

    def __init__(self, context: DispatchContext, inner: CompletionHook) -> None:
        self._context = context
        self._inner = inner

    def started(self, requests: Sequence[QueuedRequest], pass_id: str) -> None:
        self._context.started(requests)
        self._inner.started(requests, pass_id)

    def finished(self, completions: Sequence[Completion], pass_id: str | None,
                 store: StoreResults) -> list[Completion]:
        return self._inner.finished(completions, pass_id, store)
