"""`OwnedIds` and `OwnedFacts`: which (tenant, id) pairs — models, sampling sessions — this process has already
seen the tenant own, and (`OwnedFacts`) what it read about them that never changes.

The gateway checks that a `forward_backward`'s model is the caller's before it densifies the request's tensors
(a foreign or unknown model id gets its 404 before any allocation). That check was one database transaction
and two thread hops per request, paid again on every step of a training loop although a model's owner never
changes. Only positive answers are kept: a model id of another tenant, or an unknown one, is looked up every
time, so what the memory spares is exactly the re-check of a tenant's own model. A model deleted or unloaded
meanwhile stays "owned" here, which is harmless: the ordered submission re-reads the run row inside its own
transaction and answers 404 there, as it always did; the memory only decides whether the tensors are
densified before that answer. The batched sampling poller (`retrieve_futures`, several polls per sample)
checks its sampling session the same way, and a sample submission keeps the sampling session's fields it
needs in an `OwnedFacts` (a sampling session row is never deleted, and those fields never change).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

DEFAULT_CAPACITY = 65_536
"""Pairs remembered (about 100 bytes each, plus their facts); the least recently used pair goes first."""

V = TypeVar("V")


class OwnedFacts(Generic[V]):
    """A bounded, thread-safe map from (tenant id, resource id) pairs known to be owned to facts about the
    resource that never change (LRU order). Only a lookup that found the tenant's resource may fill it."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        self._pairs: OrderedDict[tuple[str, str], V] = OrderedDict()
        # Read from the event loop and from decode threads, written after a lookup on any of them.
        self._lock = threading.Lock()

    def remember(self, tenant_id: str, resource_id: str, facts: V) -> None:
        """`tenant_id` owns `resource_id`, whose unchanging `facts` a lookup just read."""
        if self._capacity == 0:
            return
        key = (tenant_id, resource_id)
        with self._lock:
            self._pairs[key] = facts
            self._pairs.move_to_end(key)
            while len(self._pairs) > self._capacity:
                self._pairs.popitem(last=False)

    def get(self, tenant_id: str, resource_id: str) -> V | None:
        """The facts of `resource_id` if a lookup already found it to be `tenant_id`'s (None: look it up)."""
        key = (tenant_id, resource_id)
        with self._lock:
            facts = self._pairs.get(key)
            if facts is not None:
                self._pairs.move_to_end(key)
            return facts

    def __len__(self) -> int:
        with self._lock:
            return len(self._pairs)


class OwnedIds:
    """A bounded, thread-safe set of (tenant id, resource id) pairs known to be owned (LRU order)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._owned: OwnedFacts[bool] = OwnedFacts(capacity)

    def remember(self, tenant_id: str, resource_id: str) -> None:
        """`tenant_id` owns `resource_id` (a lookup just said so)."""
        self._owned.remember(tenant_id, resource_id, True)

    def known(self, tenant_id: str, resource_id: str) -> bool:
        """Whether a lookup already found `resource_id` to be `tenant_id`'s (False means: look it up)."""
        return self._owned.get(tenant_id, resource_id) is not None

    def __len__(self) -> int:
        return len(self._owned)
