"""Per-model seq_id sequencing: release each model's requests strictly in seq_id order, exactly once.

The Tinker SDK numbers every training-side call of a model consecutively (create/load is seq 0, the first
training request seq 1), sends chunks 2..n of a `forward_backward` *before* chunk 1 on purpose, and
retries freely. So per model we keep the next expected seq_id, a heap of early arrivals, and a
`seq_id -> request_id` map so a retry gets the id of the request already known. A seq_id the gateway
rejected at the edge still counts as used (`mark_consumed`): the SDK moves on to the next one, and so
must we, or the model would wait forever.

Sampling is unordered; `UnorderedDedupe` only maps `(sampling_session_id, seq_id)` retries onto one id.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.scheduler.requests import ModelId, QueuedRequest, RequestId

DEFAULT_DEDUPE_WINDOW = 4096
"""How many seq_ids behind the model's position we still recognise as duplicates."""


class StaleSeqIdError(ValueError):
    """A seq_id the model has already moved past, whose request id is no longer (or never was) known."""


@dataclass
class _Stream:
    """One model's sequencing state."""

    next_seq: int
    opened: int = 0
    """When it was opened among the sequencer's streams: `drain` releases models in this order."""
    early: list[tuple[int, QueuedRequest]] = field(default_factory=list)
    """Min-heap of arrivals ahead of `next_seq`; seq_ids are unique within it (dedupe runs first)."""
    skipped: set[int] = field(default_factory=set)
    """Consumed seq_ids at or after `next_seq` (rejected at the edge, or failed at admission)."""
    ids: dict[int, RequestId] = field(default_factory=dict)
    """seq_id -> request_id, for dedupe; pruned `window` seq_ids behind `next_seq`."""
    released: list[QueuedRequest] = field(default_factory=list)
    """In-order requests not yet taken by `ready()`."""


class Sequencer:
    """Releases each model's requests in seq_id order; dedupes retries; skips consumed seq_ids."""

    def __init__(self, dedupe_window: int = DEFAULT_DEDUPE_WINDOW) -> None:
        if dedupe_window < 1:
            raise ValueError(f"dedupe_window must be >= 1, got {dedupe_window}")
        self._window = dedupe_window
        self._streams: dict[ModelId, _Stream] = {}
        # The few models with something to hand out, so that draining and counting early arrivals (each
        # loop iteration, for every model ever opened) cost what is there, not the number of models.
        self._releasing: set[ModelId] = set()
        self._early: set[ModelId] = set()
        self._opened = itertools.count()

    def open(self, model_id: ModelId, next_seq_id: int = 0) -> None:
        """Start (or restart after recovery) a model at `next_seq_id`. Unknown models start at 0."""
        if model_id not in self._streams:
            self._streams[model_id] = _Stream(next_seq=next_seq_id, opened=next(self._opened))

    def forget(self, model_id: ModelId) -> list[QueuedRequest]:
        """Drop a model; returns its requests that were waiting (early or released but not taken)."""
        stream = self._streams.pop(model_id, None)
        self._releasing.discard(model_id)
        self._early.discard(model_id)
        if stream is None:
            return []
        return stream.released + [req for _, req in sorted(stream.early, key=lambda e: e[0])]

    def submit(self, request: QueuedRequest) -> tuple[RequestId, bool]:
        """Admit an ordered request; returns (request_id, is_new).

        A duplicate `(model_id, seq_id)` returns the known request's id and `is_new=False`. Raises
        `StaleSeqIdError` for a seq_id behind the model whose id is not known any more.
        """
        assert request.seq_id is not None, "ordered requests carry a seq_id (checked at admission)"
        stream = self._stream(request.model_id)
        seq = request.seq_id
        known = stream.ids.get(seq)
        if known is not None:
            return known, False
        if seq < stream.next_seq or seq in stream.skipped:
            raise StaleSeqIdError(
                f"seq_id {seq} of model {request.model_id} was already used (next expected {stream.next_seq})"
            )
        stream.ids[seq] = request.request_id
        heapq.heappush(stream.early, (seq, request))
        self._advance(request.model_id, stream)
        return request.request_id, True

    def mark_consumed(self, model_id: ModelId, seq_id: int, request_id: RequestId | None = None) -> bool:
        """Record that `seq_id` will never arrive as a request (rejected at the edge), so it must not block.

        With `request_id`, later duplicates of this seq_id map to it (the gateway stored its error result).
        Returns False when the seq_id was already submitted or consumed (nothing changes).
        """
        stream = self._stream(model_id)
        if seq_id in stream.ids or seq_id in stream.skipped or seq_id < stream.next_seq:
            if request_id is not None and seq_id >= stream.next_seq - self._window:
                stream.ids.setdefault(seq_id, request_id)
            return False
        stream.skipped.add(seq_id)
        if request_id is not None:
            stream.ids[seq_id] = request_id
        self._advance(model_id, stream)
        return True

    def ready(self, model_id: ModelId) -> list[QueuedRequest]:
        """Take the requests of `model_id` that are now next in order (each returned once)."""
        stream = self._streams.get(model_id)
        if stream is None or not stream.released:
            return []
        taken, stream.released = stream.released, []
        self._releasing.discard(model_id)
        return taken

    def drain(self) -> Iterator[QueuedRequest]:
        """Take every model's newly in-order requests (per model in seq order)."""
        for model_id in sorted(self._releasing, key=lambda m: self._streams[m].opened):
            yield from self.ready(model_id)

    def known(self, model_id: ModelId, seq_id: int) -> RequestId | None:
        """The request id already recorded for `(model_id, seq_id)`, if any (within the dedupe window)."""
        stream = self._streams.get(model_id)
        return None if stream is None else stream.ids.get(seq_id)

    def next_seq_id(self, model_id: ModelId) -> int:
        stream = self._streams.get(model_id)
        return 0 if stream is None else stream.next_seq

    def waiting(self) -> Iterator[QueuedRequest]:
        """Early arrivals held back by a missing seq_id (for queue-depth stats)."""
        for model_id in list(self._early):
            yield from (req for _, req in self._streams[model_id].early)

    def _stream(self, model_id: ModelId) -> _Stream:
        self.open(model_id)
        return self._streams[model_id]

    def _advance(self, model_id: ModelId, stream: _Stream) -> None:
        """Release everything that is now contiguous with the model's position."""
        while True:
            if stream.early and stream.early[0][0] == stream.next_seq:
                stream.released.append(heapq.heappop(stream.early)[1])
            elif stream.next_seq in stream.skipped:
                stream.skipped.discard(stream.next_seq)
            else:
                break
            # Every seq_id is passed exactly once, so this prunes the dedupe map without scanning it.
            stream.ids.pop(stream.next_seq - self._window, None)
            stream.next_seq += 1
        if stream.released:
            self._releasing.add(model_id)
        if stream.early:
            self._early.add(model_id)
        else:
            self._early.discard(model_id)


class UnorderedDedupe:
    """`(sampling_session_id, seq_id) -> request_id` for unordered requests, bounded (oldest evicted)."""

    def __init__(self, capacity: int = 65536) -> None:
        self._capacity = capacity
        self._ids: OrderedDict[tuple[ModelId, int], RequestId] = OrderedDict()

    def admit(self, request: QueuedRequest) -> tuple[RequestId, bool]:
        """(request_id, is_new); a request without seq_id is always new."""
        if request.seq_id is None:
            return request.request_id, True
        key = (request.model_id, request.seq_id)
        known = self._ids.get(key)
        if known is not None:
            return known, False
        self._ids[key] = request.request_id
        if len(self._ids) > self._capacity:
            self._ids.popitem(last=False)
        return request.request_id, True
