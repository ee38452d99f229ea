"""Adapter banks: the resident adapters' LoRA factors kept as rows of one stacked tensor per layer.

A grouped multi-LoRA pass needs every adapter's factors of a layer as one (adapters, rank, in) tensor
for its batched GEMMs. Stacking them per pass copied every factor of every tenant on every step (on the
small-step CPU bench: 58 copies, ~8 ms of a ~90 ms step, plus fresh memory each time). Here each
adapter's factors *live* in a row of such a stack: its parameters are views of that row, so a pass whose
adapters sit in consecutive rows reads the stack as it is, and any other subset of one bank costs one
gather instead of a copy per adapter.

Adapters stay separate autograd leaves (a view's gradient is its own tensor), so gradients, the
per-adapter optimizer and checkpoints see nothing different. A bank holds adapters of one rank and
one set of layers (a "class"); rows are handed out lowest-first so tenants created together sit
together, and a full bank grows by a quarter. An adapter leaving residency (spill, drop) gets private copies
of its factors back before its row is reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.engine.passes import LayerBank

if TYPE_CHECKING:
    from worker.engine.adapters import AdapterState

_INITIAL_ROWS = 2


@dataclass(frozen=True)
class BankPlacement:
    """Where a resident adapter's factors live: row `slot` of every layer bank of one class."""

    bank: ClassBank
    slot: int

    @property
    def layers(self) -> dict[str, LayerBank]:
        return self.bank.layers


class ClassBank:
    """Stacked factors of the resident adapters that share one rank and one set of layers."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]], device: torch.device,
                 dtype: torch.dtype, ordinal: int) -> None:
        self.ordinal = ordinal
        self._device, self._dtype = device, dtype
        self.layers = {name: LayerBank(self._empty(a), self._empty(b)) for name, (a, b) in shapes.items()}
        self._owners: list[AdapterState | None] = [None] * _INITIAL_ROWS

    def _empty(self, shape: tuple[int, ...], rows: int = _INITIAL_ROWS) -> torch.Tensor:
        return torch.zeros((rows, *shape), device=self._device, dtype=self._dtype)

    @property
    def occupied(self) -> int:
        return sum(owner is not None for owner in self._owners)

    def take(self, state: AdapterState) -> int:
        """Move `state`'s factors into the lowest free row; its parameters become views of that row."""
        slot = next((i for i, owner in enumerate(self._owners) if owner is None), None)
        if slot is None:
            slot = len(self._owners)
            # Grow by a quarter: a row is an adapter's worth of factors (45 MB at rank 32 on SmolLM2-135M),
            # so doubling would leave up to half the bank idle; growing copies the bank, once per growth.
            self._grow(max(slot + 1, slot * 5 // 4))
        self._owners[slot] = state
        with torch.no_grad():
            for name, bank in self.layers.items():
                _adopt(state, f"{name}.lora_A", bank.A[slot])
                _adopt(state, f"{name}.lora_B", bank.B[slot])
        return slot

    def give_back(self, state: AdapterState, slot: int) -> None:
        """Give `state` private copies of its factors and free its row."""
        with torch.no_grad():
            for p in state.params.values():
                p.data = p.data.clone()
        self._owners[slot] = None

    def _grow(self, rows: int) -> None:
        used = len(self._owners)
        with torch.no_grad():
            for bank in self.layers.values():
                bank.A = torch.cat([bank.A, self._empty(bank.A.shape[1:], rows - used)])
                bank.B = torch.cat([bank.B, self._empty(bank.B.shape[1:], rows - used)])
        self._owners.extend([None] * (rows - used))
        for slot, owner in enumerate(self._owners):
            if owner is not None:  # re-point the resident adapters at the new storage
                for name, bank in self.layers.items():
                    owner.params[f"{name}.lora_A"].data = bank.A[slot]
                    owner.params[f"{name}.lora_B"].data = bank.B[slot]


def _adopt(state: AdapterState, key: str, row: torch.Tensor) -> None:
    param = state.params[key]
    row.copy_(param.data)
    param.data = row


class AdapterBanks:
    """One `ClassBank` per (rank, layers, dtype, device); places and releases resident adapters."""

    def __init__(self) -> None:
        self._classes: dict[tuple[object, ...], ClassBank] = {}

    def place(self, state: AdapterState) -> None:
        if state.placement is not None:
            return
        shapes = _factor_shapes(state)
        first = next(iter(state.params.values()))
        key = (tuple(sorted(shapes.items())), first.dtype, first.device)
        bank = self._classes.get(key)
        if bank is None:
            bank = ClassBank(shapes, first.device, first.dtype, ordinal=len(self._classes))
            self._classes[key] = bank
        state.placement = BankPlacement(bank, bank.take(state))

    def release(self, state: AdapterState) -> None:
        if state.placement is None:
            return
        state.placement.bank.give_back(state, state.placement.slot)
        state.placement = None

    def rows_in_use(self) -> int:
        return sum(bank.occupied for bank in self._classes.values())


def _factor_shapes(state: AdapterState) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {name: (tuple(state.params[f"{name}.lora_A"].shape), tuple(state.params[f"{name}.lora_B"].shape))
            for name in state.layer_names()}


def order_key(state: AdapterState) -> tuple[int, int]:
    """Sort key that lays a pass's adapters out in bank order (unplaced adapters last)."""
    placement = state.placement
    return (placement.bank.ordinal, placement.slot) if placement is not None else (1 << 30, 0)
