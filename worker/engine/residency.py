"""Adapter slots: which adapters are resident on the compute device, with an LRU that spills the rest.

Adapters stay resident between calls (never swapped per request). Beyond `max_resident`, the least
recently used adapter not pinned by the pass in flight moves, with its gradients and optimizer
state, to host memory (GPU workers) or to a spill directory (CPU workers, where host memory *is*
the device), and comes back on demand bit-for-bit.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from services.domain.training import AdapterId, LoraSpec
from worker.engine.adapters import AdapterState, OptimizerState
from worker.engine.banks import AdapterBanks
from worker.engine.passes import GradRows

SPILL_GLOBALS = (AdapterState, LoraSpec, OptimizerState, GradRows)
"""The only classes a spill file may contain: it is read with `weights_only=True`, so a file planted in the
spill directory cannot run code; a new class in `AdapterState` must be added here (the residency tests
fail until it is)."""

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
        self._on_disk: dict[AdapterId, Path] = {}
        self._spill_to_disk = device.type == "cpu"
        self._spill_dir = spill_dir
        self.banks = AdapterBanks()
        self.spills = 0
        self.restores = 0

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
        return state

    def drop(self, adapter_id: AdapterId) -> None:
        state = self._resident.pop(adapter_id, None)
        if state is not None:
            self.banks.release(state)
        self._on_host.pop(adapter_id, None)
        path = self._on_disk.pop(adapter_id, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def _evict(self, pinned: set[AdapterId]) -> None:
        while len(self._resident) > self.max_resident:
            victim = next((a for a in self._resident if a not in pinned), None)
            if victim is None:
                return  # everything resident is in use by this pass: exceed the cap rather than thrash
            self._spill(self._resident.pop(victim))

    def _spill(self, state: AdapterState) -> None:
        self.spills += 1
        self.banks.release(state)
        if not self._spill_to_disk:
            state.to("cpu")
            self._on_host[state.adapter_id] = state
            return
        path = self._spill_path(state.adapter_id)
        torch.save(_to_blob(state), path)
        self._on_disk[state.adapter_id] = path
        log.debug("spilled adapter %s to %s", state.adapter_id, path)

    def _restore(self, adapter_id: AdapterId) -> AdapterState:
        self.restores += 1
        if adapter_id in self._on_host:
            state = self._on_host.pop(adapter_id)
            state.to(self.device)
            return state
        if adapter_id in self._on_disk:
            path = self._on_disk.pop(adapter_id)
            with torch.serialization.safe_globals(list(SPILL_GLOBALS)):
                state = _from_blob(torch.load(path, weights_only=True), self.device)
            path.unlink(missing_ok=True)
            return state
        raise UnknownAdapter(adapter_id)

    def _spill_path(self, adapter_id: AdapterId) -> Path:
        if self._spill_dir is None:
            self._spill_dir = Path(tempfile.mkdtemp(prefix="carpool-spill-"))
        self._spill_dir.mkdir(parents=True, exist_ok=True)
        # Sanitised names can collide ("run/1" vs "run_1"): a digest of the real id keeps them apart.
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in adapter_id)[:64]
        digest = hashlib.sha256(adapter_id.encode()).hexdigest()[:16]
        return self._spill_dir / f"{safe}-{digest}.pt"


def _to_blob(state: AdapterState) -> dict[str, object]:
    return {
        "state": state,
        "params": {k: p.detach() for k, p in state.params.items()},
        "grads": {k: p.grad for k, p in state.params.items() if p.grad is not None},
    }


def _from_blob(blob: dict[str, object], device: torch.device) -> AdapterState:
    state: AdapterState = blob["state"]  # type: ignore[assignment]
    grads: dict[str, torch.Tensor] = blob["grads"]  # type: ignore[assignment]
    for key, tensor in blob["params"].items():  # type: ignore[attr-defined]
        p = nn.Parameter(tensor.to(device), requires_grad=True)
        if key in grads:
            p.grad = grads[key].to(device)
        state.params[key] = p
    state.to(device)
    return state
