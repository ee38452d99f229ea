"""Adapter banks: the resident adapters' LoRA factors kept as rows of one stacked tensor per layer.

A grouped multi-LoRA pass needs every adapter's factors of a layer as one (adapters, rank, in) tensor
for its batched GEMMs. Stacking them per pass copied every factor of every tenant on every step (on the
small-step CPU bench: 58 copies, ~8 ms of a ~90 ms step, plus fresh memory each time). Here each
adapter's factors *live* in a row of such a stack: its parameters are views of that row, so a pass whose
adapters sit in consecutive rows reads the stack as it is, and any other subset of one bank costs one
gather instead of a copy per adapter.

Adapters stay separate autograd leaves, and each has gradient rows beside its factor rows: passes write
a banked adapter's gradients there (worker/engine/grad_rows.py), `AdapterState.grads()` reads them, and an
adapter leaving its row takes a pending gradient along as `.grad`. A bank holds adapters of one rank and
one set of layers (a "class"); rows are handed out lowest-first so tenants created together sit
together, and a full bank grows by a quarter. An adapter leaving residency (spill, drop) gets private copies
of its factors back before its row is reused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from worker.engine.passes import LayerBank

if TYPE_CHECKING:
    from worker.engine.adapters import AdapterState

_INITIAL_ROWS = 2
_KEPT_RUNS = 32
"""Runs of rows (`ClassBank.runs`) a bank keeps made: four kinds for each of a few groups of consecutive tenants."""


KINDS = ("", "grad", "exp_avg", "exp_avg_sq")
"""What a bank keeps per layer, factor by factor: the factors, their gradients and their AdamW moments."""


@dataclass(frozen=True)
class BankPlacement:
    """Where a resident adapter's factors live: row `slot` of every layer bank of one class."""

    bank: ClassBank
    slot: int

    @property
    def layers(self) -> dict[str, LayerBank]:
        return self.bank.layers

    def grads(self) -> dict[str, torch.Tensor]:
        """The adapter's gradient rows as views, by parameter name."""
        return dict(self.bank.rows("grad", self.slot))

    def moment_row(self, kind: str, key: str) -> torch.Tensor:
        """The adapter's row of AdamW moment `kind` ("exp_avg" or "exp_avg_sq") for parameter `key`."""
        layer, factor = key.rsplit(".", 1)
        return self.bank.layers[layer].rows(kind, _FACTOR[factor])[self.slot]


_FACTOR = {"lora_A": "A", "lora_B": "B"}


class ClassBank:
    """Stacked factors (and their gradients and moments) of resident adapters sharing a rank and layers."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]], device: torch.device,
                 dtype: torch.dtype, ordinal: int) -> None:
        self.ordinal = ordinal
        self._device, self._dtype = device, dtype
        self.layers = {name: LayerBank(*(self._empty(shape) for _ in KINDS for shape in (a, b)))
                       for name, (a, b) in shapes.items()}
        self._owners: list[AdapterState | None] = [None] * _INITIAL_ROWS
        self._views: dict[tuple[str, int], list[tuple[str, torch.Tensor]]] = {}
        """`rows()` per (kind, slot), made once per storage: every placement of an adapter (each restore of a
        spilled one) views its four kinds of rows, ~120 views, a fifth of a swap when built per call."""
        self._runs: OrderedDict[tuple[str, int, int], list[torch.Tensor]] = OrderedDict()
        """`runs()` per (kind, start, stop), made once per storage: a step of many tenants in consecutive rows
        asks for the same runs every time (four kinds of ~60 views each). The most recent `_KEPT_RUNS` only:
        with many tenants coming and going the runs of rows differ from step to step."""

    def _empty(self, shape: tuple[int, ...], rows: int = _INITIAL_ROWS) -> torch.Tensor:
        return torch.zeros((rows, *shape), device=self._device, dtype=self._dtype)

    @property
    def occupied(self) -> int:
        return sum(owner is not None for owner in self._owners)

    def rows(self, kind: str, slot: int) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, row view) of `kind` for every factor of the adapter in `slot`. Shared, made once
        per storage: callers read the list and may hand the views out, never change either."""
        views = self._views.get((kind, slot))
        if views is None:
            views = self._views[(kind, slot)] = [(f"{name}.lora_{f}", layer.rows(kind, f)[slot])
                                                 for name, layer in self.layers.items() for f in "AB"]
        return views

    def runs(self, kind: str, start: int, stop: int) -> list[torch.Tensor]:
        """Every layer's `kind` stacks cut to rows [start, stop): several adapters' tensors as one each. Shared,
        made once per storage, like `rows()`."""
        key = (kind, start, stop)
        views = self._runs.get(key)
        if views is None:
            views = self._runs[key] = [layer.rows(kind, f)[start:stop] for layer in self.layers.values() for f in "AB"]
            if len(self._runs) > _KEPT_RUNS:
                self._runs.popitem(last=False)
        else:
            self._runs.move_to_end(key)
        return views

    def take(self, state: AdapterState) -> int:
        """Move `state`'s factors, pending gradient and moments into the lowest free row; its parameters
        and moment entries become views of that row."""
        slot = self._free_slot()
        self._owners[slot] = state
        with torch.no_grad():
            rows = self.rows("", slot)
            # One copy call per kind, not one per tensor: each torch call lets go of the GIL, and on a busy
            # server taking it back waits behind the gateway's threads (bench/load.py at 512 tenants, where
            # every step brings an adapter back: ~120 calls per swap before).
            torch._foreach_copy_([row for _, row in rows], [state.params[key] for key, _ in rows])
            for key, row in rows:
                state.params[key].data = row
            state.grad_rows.valid = self._adopt_grads(state, slot)
            for kind in ("exp_avg", "exp_avg_sq"):
                _adopt_moments(getattr(state.optimizer, kind), self.rows(kind, slot))
        return slot

    def _free_slot(self) -> int:
        slot = next((i for i, owner in enumerate(self._owners) if owner is None), None)
        if slot is None:
            slot = len(self._owners)
            # Grow by a quarter: a row is an adapter's worth of factors (45 MB at rank 32 on SmolLM2-135M),
            # so doubling would leave up to half the bank idle; growing copies the bank, once per growth.
            self._grow(max(slot + 1, slot * 5 // 4))
        return slot

    def _adopt_grads(self, state: AdapterState, slot: int) -> bool:
        """An adapter coming back with a pending gradient keeps it, in its rows; True if it had one."""
        rows = self.rows("grad", slot)
        pairs = [(row, state.params[key].grad) for key, row in rows]
        present = [(row, grad) for row, grad in pairs if grad is not None]
        if not present:
            return False
        missing = [row for row, grad in pairs if grad is None]
        torch._foreach_copy_([row for row, _ in present], [grad for _, grad in present])
        if missing:
            torch._foreach_zero_(missing)
        for key, _ in rows:
            state.params[key].grad = None
        return True

    def give_back(self, state: AdapterState, slot: int) -> None:
        """Give `state` private copies of its factors, moments and pending gradient; free its row."""
        grads = state.grads()
        with torch.no_grad():
            for key, p in state.params.items():
                p.data = p.data.clone()
                p.grad = grads[key].clone() if key in grads else None
            for moments in (state.optimizer.exp_avg, state.optimizer.exp_avg_sq):
                for key, t in moments.items():
                    moments[key] = t.clone()
        state.grad_rows.valid = False
        self._owners[slot] = None

    def vacate(self, slot: int) -> None:
        self._owners[slot] = None

    def _grow(self, rows: int) -> None:
        used = len(self._owners)
        self._views.clear()  # views of the storage being replaced
        self._runs.clear()
        with torch.no_grad():
            for bank in self.layers.values():
                for f in fields(bank):
                    stack = getattr(bank, f.name)
                    setattr(bank, f.name, torch.cat([stack, self._empty(stack.shape[1:], rows - used)]))
        self._owners.extend([None] * (rows - used))
        for slot, owner in enumerate(self._owners):
            if owner is not None:  # re-point the resident adapters at the new storage
                for key, row in self.rows("", slot):
                    owner.params[key].data = row
                for kind in ("exp_avg", "exp_avg_sq"):
                    moments = getattr(owner.optimizer, kind)
                    moments.update((key, row) for key, row in self.rows(kind, slot) if key in moments)


def _adopt_moments(moments: dict[str, torch.Tensor], rows: list[tuple[str, torch.Tensor]]) -> None:
    # Only moments that exist move in: an adapter that never stepped keeps an empty optimizer state.
    present = [(key, row) for key, row in rows if key in moments]
    if not present:
        return
    torch._foreach_copy_([row for _, row in present], [moments[key] for key, _ in present])
    for key, row in present:
        moments[key] = row


class AdapterBanks:
    """One `ClassBank` per (rank, layers, dtype, device); places and releases resident adapters."""

    def __init__(self) -> None:
        self._classes: dict[tuple[object, ...], ClassBank] = {}

    def place(self, state: AdapterState) -> None:
        if state.placement is not None:
            return
        shapes = _factor_shapes(state)
        first = next(iter(state.params.values()))
        # Sampler copies in a class of their own: one per tenant, made between its training steps, they would
        # otherwise take every other row, and a pass over scattered rows gathers its factors and scatters its
        # gradients in every layer (and AdamW takes a tensor per adapter instead of one per run of rows).
        key = (tuple(sorted(shapes.items())), first.dtype, first.device, state.sampling_only)
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

    def vacate(self, state: AdapterState) -> None:
        """Free `state`'s row without giving it private copies first (`release` does): for an adapter whose
        tensors were just written elsewhere (a spill file) and are dropped next. Its tensors still view the
        row, which the next adapter placed there overwrites."""
        if state.placement is None:
            return
        state.grad_rows.valid = False
        state.placement.bank.vacate(state.placement.slot)
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
