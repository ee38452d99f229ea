"""Runs a step's plan items on a `Backend`: barriers one by one, each packed pass as ONE backend call.

This is the product's core: a `PassPlan` holds several tenants' forward/backward requests, and all of
them go to the backend in a single `forward_backward([...])` call, so they share the base model's GEMMs.
Sample batches likewise become one `sample([...])` call.

Every backend call is wrapped: an exception fails only the item that raised (category `server`, logged
with its request ids), never the loop. `Fenced` is the exception: a replica refused the call because a
newer scheduler holds the lease, so this scheduler has been deposed and the item is not its to answer. It
propagates (the loop logs it and carries on until its service notices the lost lease): no result is
stored, no entry acked, and the leader adopts the entries (`recovery.GuardedQueue`) and runs them.

A packed pass of several requests that raises is run again one request at a time, so one tenant's poison
input (or an allocation only its data needs) fails only that tenant's request, and nobody sees another
tenant's error text. Results come back as the scheduler's
`complete()` expects them: one per request in the item's order, or a single `WorkError` for the whole item.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from services.domain.backend import Backend
from services.domain.sampling import SampleResult
from services.domain.training import WorkError
from services.runtime.commands import BarrierCommand, ForwardBackward, Sample
from services.runtime.replica_protocol import Fenced
from services.runtime.reporting import LoopCounters
from services.scheduler.requests import BarrierPlan, PassPlan, PlanItem, QueuedRequest, SampleBatchPlan

log = logging.getLogger(__name__)

ItemResults = Sequence[object] | WorkError
_T = TypeVar("_T")


class Dispatcher:
    """Executes plan items against one backend and counts what ran."""

    def __init__(self, backend: Backend, counters: LoopCounters, base_model: str) -> None:
        self._backend = backend
        self._counters = counters
        self._base_model = base_model

    def run(self, item: PlanItem) -> ItemResults:
        """Run any plan item; raises nothing but `Fenced` (see the module docstring). The loop thread's CPU
        since its last lap is billed to the item's kind of backend call (`LoopCounters.cpu`)."""
        if isinstance(item, PassPlan):
            return self._guarded(item, self._packed_pass, "pass")
        if isinstance(item, BarrierPlan):
            return self._guarded(item, self._barrier, "barrier")
        return self._guarded(item, self._sample_batch, "sample_batch")

    def _guarded(self, item: PlanItem, run: Callable[[PlanItem], ItemResults], cpu_part: str) -> ItemResults:
        try:
            return run(item)
        except Fenced:
            log.warning("%s: %s fenced: a newer scheduler leads; leaving requests %s to it", self._base_model,
                        type(item).__name__, ", ".join(r.request_id for r in item.requests))
            raise
        except Exception as exc:  # noqa: BLE001 - any backend failure must fail this item only
            ids = ", ".join(r.request_id for r in item.requests)
            log.exception("%s: %s failed (requests %s)", self._base_model, type(item).__name__, ids)
            message = f"internal error while running the request: {type(exc).__name__}: {exc}"
            return WorkError(message, "server")
        finally:
            self._counters.cpu.lap(cpu_part)

    def _barrier(self, item: PlanItem) -> ItemResults:
        assert isinstance(item, BarrierPlan)
        command = item.request.payload
        if not isinstance(command, BarrierCommand):
            kind = item.request.kind.value
            raise TypeError(f"{kind} request carries {type(command).__name__}, not a command")
        started = time.perf_counter()
        outcome = command.run(self._backend)
        self._counters.record_barrier(time.perf_counter() - started, item.request.kind.value)
        log.debug("%s: %s of %s done", self._base_model, type(command).__name__, item.request.model_id)
        return [outcome]

    def _packed_pass(self, item: PlanItem) -> ItemResults:
        assert isinstance(item, PassPlan)
        works = [_payload(r, ForwardBackward).work for r in item.requests]
        started = time.perf_counter()
        try:
            results = self._backend.forward_backward(works)
        except Fenced:
            raise
        except Exception:
            if len(works) < 2:
                raise
            log.exception("%s pass %s failed; running its %d requests one by one", self._base_model,
                          item.item_id, len(works))
            return self._one_by_one(item)
        seconds = time.perf_counter() - started
        rate = self._counters.record_pass(item.num_tokens, len(item.tenants), seconds, len(item.segments))
        log.info(
            "%s pass %s: %d requests, %d tokens, %d tenants, %d adapters, %.1f ms, %.0f tokens/s",
            self._base_model, item.item_id, len(works), item.num_tokens, len(item.tenants),
            len(item.segments), seconds * 1000, rate,
        )
        return results

    def _one_by_one(self, item: PassPlan) -> list[object]:
        """Each request of a failed pass alone; one that fails again gets its own error only."""
        results: list[object] = []
        for request in item.requests:
            try:
                results.extend(self._backend.forward_backward([_payload(request, ForwardBackward).work]))
            except Fenced:
                raise
            except Exception as exc:  # noqa: BLE001 - this request's own failure, reported to it alone
                log.exception("%s: request %s failed on its own", self._base_model, request.request_id)
                results.append(WorkError(f"internal error while running the request: {type(exc).__name__}: "
                                         f"{exc}", "server"))
        return results

    def _sample_batch(self, item: PlanItem) -> ItemResults:
        assert isinstance(item, SampleBatchPlan)
        works = [_payload(r, Sample).work for r in item.requests]
        started = time.perf_counter()
        results = self._backend.sample(works)
        seconds = time.perf_counter() - started
        generated = sum(len(s.tokens) for r in results if isinstance(r, SampleResult) for s in r.sequences)
        self._counters.record_sample_batch(seconds, generated)
        log.info("%s sample batch %s: %d requests, %d tokens generated, %.1f ms",
                 self._base_model, item.item_id, len(works), generated, seconds * 1000)
        return results


def _payload(request: QueuedRequest, expected: type[_T]) -> _T:
    payload = request.payload
    if not isinstance(payload, expected):
        raise TypeError(f"{request.kind.value} request {request.request_id} carries "
                        f"{type(payload).__name__}, not {expected.__name__}")
    return payload
