"""Adapter slots: which adapters are resident on the compute device, with an LRU that spills the rest.

Adapters stay resident between calls (never swapped per request). Beyond `max_resident`, the least
recently used adapter not pinned by the pass in flight moves, with its gradients and optimizer
state, to host memory (GPU workers) or to a spill directory (CPU workers, where host memory *is*
the device), and comes back on demand bit-for-bit.

How spilled adapters are stored (raw bytes in one anonymous file, slots reused, layouts shared) is
`worker/engine/spill_files.py`'s business.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from services.domain.training import AdapterId
from worker.engine.adapters import AdapterState
from worker.engine.banks import AdapterBanks
from worker.engine.spill_files import SpillFileCorrupt, SpillRecord, SpillStore, strip_tensors

__all__ = ["AdapterSlots", "SpillFileCorrupt", "UnknownAdapter"]

log = logging.getLogger(__name__)


class UnknownAdapter(KeyError):
    def __init__(self, adapter_id: str) -> None:
        super().__init__(adapter_id)
        self.adapter_id = adapter_id

    def __str__(self) -> str:
        return f"adapter {self.adapter_id!r} does not exist on this worker (create or load it first)"


class AdapterSlots:
    """Resident adapters in LRU order plus spilled ones; `get` brings an adapter back when needed.

    Resident adapters' factors live in `banks` (stacked rows a grouped pass reads without copying);
    an adapter leaves its row whenever it stops being resident.
    """

    def __init__(self, device: torch.device, max_resident: int, spill_dir: Path | None = None) -> None:
        if max_resident < 1:
            raise ValueError("max_resident must be >= 1")
        self.device = device
        self.max_resident = max_resident
        self._resident: OrderedDict[AdapterId, AdapterState] = OrderedDict()
        self._on_host: dict[AdapterId, AdapterState] = {}
        self._on_disk: dict[AdapterId, SpillRecord] = {}
        self._spill_to_disk = device.type == "cpu"
        self._store = SpillStore(spill_dir)
        self.banks = AdapterBanks()
        self.spills = 0
        self.restores = 0
        self._parked: dict[AdapterId, Callable[[AdapterState], None]] = {}
        """Work left with a spilled adapter, run on it when it next comes back (`park`)."""

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._resident or adapter_id in self._on_host or adapter_id in self._on_disk

    def __len__(self) -> int:
        return len(self._resident) + len(self._on_host) + len(self._on_disk)

    def ids(self) -> list[AdapterId]:
        return [*self._resident, *self._on_host, *self._on_disk]

    def resident_ids(self) -> list[AdapterId]:
        return list(self._resident)

    def is_resident(self, adapter_id: AdapterId) -> bool:
        return adapter_id in self._resident

    def put(self, state: AdapterState, pinned: Iterable[AdapterId] = ()) -> None:
        self.drop(state.adapter_id)
        self.banks.place(state)
        self._resident[state.adapter_id] = state
        self._evict(set(pinned) | {state.adapter_id})

    def get(self, adapter_id: AdapterId, pinned: Iterable[AdapterId] = ()) -> AdapterState:
        """The adapter, resident on the device; `pinned` adapters (the current pass) are never evicted."""
        state = self._resident.get(adapter_id)
        if state is not None:
            self._resident.move_to_end(adapter_id)
            return state
        state = self._restore(adapter_id)
        self.banks.place(state)
        self._resident[adapter_id] = state
        self._evict(set(pinned) | {adapter_id})
        parked = self._parked.pop(adapter_id, None)
        if parked is not None:
            parked(state)
        return state

    def park(self, adapter_id: AdapterId, work: Callable[[AdapterState], None]) -> bool:
        """Leave `work` with a spilled adapter instead of bringing it back now: `get` runs it on the adapter
        as soon as it is resident again, before anyone sees it. False (nothing parked) when the adapter is
        resident, unknown, or already has parked work (run that first, through `get`).

        Why: with more live adapters than slots, a tenant's `optim_step` arrives after later passes evicted
        its adapter; bringing it back only to update it, then evicting it again for the next pass, was two of
        every step's reloads (bench/load.py at 512 tenants on 16 slots: ~2 reloads per step, one now).
        """
        if adapter_id in self._resident or adapter_id in self._parked or adapter_id not in self:
            return False
        self._parked[adapter_id] = work
        return True

    def drop(self, adapter_id: AdapterId) -> None:
        self._parked.pop(adapter_id, None)  # an adapter dropped (or replaced by `put`) needs no pending work
        state = self._resident.pop(adapter_id, None)
        if state is not None:
            self.banks.release(state)
        self._on_host.pop(adapter_id, None)
        record = self._on_disk.pop(adapter_id, None)
        if record is not None:
            self._store.free(record)

    def _evict(self, pinned: set[AdapterId]) -> None:
        while len(self._resident) > self.max_resident:
            victim = next((a for a in self._resident if a not in pinned), None)
            if victim is None:
                return  # everything resident is in use by this pass: exceed the cap rather than thrash
            self._spill(self._resident.pop(victim))

    def _spill(self, state: AdapterState) -> None:
        self.spills += 1
        if not self._spill_to_disk:
            self.banks.release(state)
            state.to("cpu")
            self._on_host[state.adapter_id] = state
            return
        try:
            # Written from where the tensors are (bank rows while placed): no private copies on the way.
            record = self._store.write(state)
        except OSError:
            # A full or unwritable disk must not lose the adapter: it stays in host memory instead.
            log.exception("could not spill adapter %s to disk; keeping it in memory", state.adapter_id)
            self.banks.release(state)
            self._on_host[state.adapter_id] = state
            return
        self.banks.vacate(state)
        strip_tensors(state)
        self._on_disk[state.adapter_id] = record

    def _restore(self, adapter_id: AdapterId) -> AdapterState:
        self.restores += 1
        if adapter_id in self._on_host:
            state = self._on_host.pop(adapter_id)
            state.to(self.device)
            return state
        if adapter_id in self._on_disk:
            record = self._on_disk.pop(adapter_id)
            try:
                return self._store.read(record, self.device)
            finally:
                self._store.free(record)
        raise UnknownAdapter(adapter_id)
