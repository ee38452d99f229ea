"""`ReplicaExecutor`: runs `ReplicaCall`s on one replica's `Backend`, exactly once per request id.

The replica side of `replica_protocol`, free of transport and of Ray: a worker replica (or a test) feeds
it envelopes one at a time and sends back the `Reply` it returns. It owns three things:

- **fencing**: a call whose fence is older than the newest one seen came from a scheduler that lost its
  lease; it is refused, so two schedulers can never interleave steps on an adapter;
- **exactly-once**: results of calls that change an adapter are remembered by request id (bounded), so a
  call repeated by a scheduler that took over is answered, not applied again;
- **snapshots**: after a call that carries a `SnapshotOrder`, the adapter's weights, optimizer state and
  pending gradients are written there (the durability the pool's request log replays on top of).
"""

from __future__ import annotations

import logging
import shutil
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from services.domain.backend import Backend, copy_adapter
from services.domain.training import AdapterId, ForwardBackwardWork
from services.runtime.replica_protocol import (
    CopyCall,
    CreateCall,
    DropCall,
    Envelope,
    LoadCall,
    OptimCall,
    OptimEntry,
    PassCall,
    ReplicaCall,
    Reply,
    RequestTag,
    RestoreCall,
    SampleCall,
    SaveCall,
    SnapshotOrder,
)
from services.storage.encrypted_saves import save_encrypted

log = logging.getLogger(__name__)

DEFAULT_REMEMBERED = 8192
"""Results of adapter-changing requests kept for repeats: far more than one scheduler has in flight."""


class ReplicaExecutor:
    """Executes calls on `backend`; `handle` never raises (failures become error replies)."""

    def __init__(self, backend: Backend, *, remembered: int = DEFAULT_REMEMBERED,
                 scratch_dir: Path | None = None) -> None:
        self._backend = backend
        self._remembered = remembered
        self._scratch_dir = scratch_dir
        self._done: OrderedDict[str, object] = OrderedDict()
        self._fence = 0
        self._handlers: dict[type, Callable[[Any], object]] = {
            PassCall: self._pass, OptimCall: self._optim, CreateCall: self._create, LoadCall: self._load,
            CopyCall: self._copy, SaveCall: self._save, SampleCall: self._sample, DropCall: self._drop,
            RestoreCall: self._restore,
        }

    def handle(self, envelope: Envelope) -> Reply:
        if envelope.fence < self._fence:
            message = f"fenced: call of lease generation {envelope.fence}, this replica follows {self._fence}"
            return Reply(envelope.call_id, error=message, fenced=True)
        self._fence = envelope.fence
        try:
            return Reply(envelope.call_id, value=self.execute(envelope.call))
        except Exception as exc:  # noqa: BLE001 - the caller turns it into an error result of its item
            log.exception("replica call %s (%s) failed", envelope.call_id, type(envelope.call).__name__)
            return Reply(envelope.call_id, error=f"{type(exc).__name__}: {exc}")

    def execute(self, call: ReplicaCall) -> object:
        return self._handlers[type(call)](call)

    # -- adapter-changing calls (remembered by request id) ----------------------------------------
    def _pass(self, call: PassCall) -> list[object]:
        return self._run_pass(call.items)

    def _run_pass(self, items: Sequence[tuple[RequestTag, ForwardBackwardWork]]) -> list[object]:
        results: list[object] = [None] * len(items)
        fresh: list[int] = []
        for i, (request_id, _work) in enumerate(items):
            if request_id is not None and request_id in self._done:
                results[i] = self._done[request_id]
            else:
                fresh.append(i)
        if fresh:
            outputs = self._backend.forward_backward([items[i][1] for i in fresh])
            for i, output in zip(fresh, outputs, strict=True):
                results[i] = output
                request_id, work = items[i]
                if not work.forward_only:  # forward-only changes nothing: running it twice is harmless
                    self._remember(request_id, output)
        return results

    def _optim(self, call: OptimCall) -> object:
        result = self._once(call.request_id, lambda: self._backend.optim_step(call.adapter_id, call.params))
        if call.snapshot is not None:
            self._write_snapshot(call.adapter_id, call.snapshot)
        return result

    def _create(self, call: CreateCall) -> None:
        self._once(call.request_id, lambda: self._backend.create_adapter(call.adapter_id, call.spec))
        self._write_snapshot(call.adapter_id, call.snapshot)

    def _load(self, call: LoadCall) -> object:
        path = Path(call.path)
        spec = self._once(call.request_id,
                          lambda: self._backend.load_adapter(call.adapter_id, path, with_optimizer=call.with_optimizer))
        self._write_snapshot(call.adapter_id, call.snapshot)
        return spec

    def _copy(self, call: CopyCall) -> None:
        self._once(call.request_id, lambda: copy_adapter(self._backend, call.source, call.target, self._scratch_dir))
        self._write_snapshot(call.target, call.snapshot)

    def _restore(self, call: RestoreCall) -> int:
        self._backend.load_adapter(call.adapter_id, Path(call.snapshot_path), with_optimizer=True)
        for request_id, result in call.applied:  # contained in the snapshot: never apply them again
            self._remember(request_id, result)
        for entry in call.log:
            if isinstance(entry, OptimEntry):
                self._optim(OptimCall(entry.request_id, call.adapter_id, entry.params))
            else:
                self._run_pass(entry.items)
        log.info("restored %s from %s and replayed %d logged calls", call.adapter_id, call.snapshot_path,
                 len(call.log))
        return len(call.log)

    # -- calls that change nothing -----------------------------------------------------------------
    def _save(self, call: SaveCall) -> int:
        if call.age_recipients:
            return save_encrypted(self._backend, call.adapter_id, Path(call.path), call.age_recipients)
        return self._backend.save_adapter(call.adapter_id, Path(call.path), with_optimizer=call.with_optimizer)

    def _sample(self, call: SampleCall) -> list[object]:
        return list(self._backend.sample(list(call.works)))

    def _drop(self, call: DropCall) -> None:
        self._backend.drop_adapter(call.adapter_id)

    # -- helpers -------------------------------------------------------------------------------------
    def _once(self, request_id: RequestTag, apply: Callable[[], object]) -> object:
        if request_id is not None and request_id in self._done:
            log.info("request %s was already applied here; answering from memory", request_id)
            return self._done[request_id]
        result = apply()
        self._remember(request_id, result)
        return result

    def _remember(self, request_id: RequestTag, result: object) -> None:
        if request_id is None:
            return
        self._done[request_id] = result
        self._done.move_to_end(request_id)
        while len(self._done) > self._remembered:
            self._done.popitem(last=False)

    def _write_snapshot(self, adapter_id: AdapterId, order: SnapshotOrder) -> None:
        self._backend.save_adapter(adapter_id, Path(order.path), with_optimizer=True)
        if order.retire is not None and order.retire != order.path:
            shutil.rmtree(order.retire, ignore_errors=True)

