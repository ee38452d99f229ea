"""Where each process's residency numbers come from: engines in `carpool serve`, the pool in a scheduler.

The composition root is the only layer that sees both the engines (worker) and the metrics collectors
(services), so the readers live here. Ray Serve replicas are not scraped themselves: the scheduler that
leads a base model drives every replica and keeps the placement map, so its metrics port reports each
replica's adapters (see docs/operations.md, "Metrics in cluster mode").
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.metrics import ReplicaSample

EMBEDDED_REPLICA = "embedded"


def process_memory_bytes() -> int | None:
    """Resident set size of this process (Linux /proc), None where that is not readable."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def engine_replicas(engines: Mapping[str, Any]) -> Callable[[], Sequence[ReplicaSample]]:
    """Residency of the in-process engines (`worker.engine.Engine`, read through its adapter slots)."""

    def read() -> list[ReplicaSample]:
        memory = process_memory_bytes()
        samples = []
        for name, engine in engines.items():
            slots = engine.slots
            samples.append(ReplicaSample(name, EMBEDDED_REPLICA, len(slots.resident_ids()), len(slots.ids()),
                                         spills=slots.spills, reloads=slots.restores, memory_bytes=memory))
        return samples

    return read


def placement_replicas(base_model: str, placement: Callable[[], Mapping[str, str] | None]
                       ) -> Callable[[], Sequence[ReplicaSample]]:
    """Adapters per replica from a scheduler's placement map (adapter id -> replica); none while standing by."""

    def read() -> list[ReplicaSample]:
        current = placement()
        if current is None:
            return []
        counts = Counter(current.values())
        return [ReplicaSample(base_model, replica, n, n) for replica, n in sorted(counts.items())]

    return read
