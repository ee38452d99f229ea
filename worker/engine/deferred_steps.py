"""Optimizer steps accepted but not yet applied, applied together just before anything reads the weights.

`optim_step` is a barrier for its own model, and tenants training in step tend to send theirs back to back.
Applying each at once costs one fused AdamW call per adapter, whose per-tensor overhead (one parallel
region for each of an adapter's ~60 small factor tensors) was a third of the optimizer's time with
eight small adapters. So the engine *prepares* a step when it arrives (clipping, metrics: everything the
caller gets back) and leaves the update here; the first engine call after it that reads or moves any
adapter's weights applies every pending step first: all adapters with the same hyper-parameters in one
update call, those of one bank at one step count as runs of consecutive rows (worker/engine/optim.py
`UpdateBatch`).

Nothing can observe a pending step: every engine entry point except `optim_step` itself applies them
before it does anything else, and an adapter's second `optim_step` applies its first. The update is
the same AdamW with the same numbers, so results equal applying each step at once (to the last bit
where the rows' lengths are multiples of the vector width, as every LoRA shape here is).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from services.domain.training import AdamParams, AdapterId
from worker.engine.adapters import AdapterState
from worker.engine.banks import ClassBank
from worker.engine.optim import UpdateBatch


class DeferredSteps:
    """Pending (prepared, not applied) AdamW steps by adapter."""

    def __init__(self) -> None:
        self._pending: dict[AdapterId, tuple[AdapterState, AdamParams]] = {}
        self.batched_calls = 0
        """Update calls made so far (one per set of hyper-parameters applied together): for tests and logs."""

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def defer(self, state: AdapterState, hp: AdamParams) -> None:
        if state.adapter_id in self._pending:
            raise RuntimeError(f"adapter {state.adapter_id!r} already has a pending step: apply it first")
        self._pending[state.adapter_id] = (state, hp)

    def apply_all(self) -> None:
        """Apply every pending step: one update call per set of hyper-parameters, in which adapters of one
        bank at one step count in consecutive rows are one run of rows."""
        pending, self._pending = self._pending, {}
        batches: dict[AdamParams, UpdateBatch] = {}
        runs: dict[tuple[object, ...], tuple[ClassBank, AdamParams, list[tuple[int, AdapterState]]]] = {}
        for state, hp in pending.values():
            update = replace(hp, grad_clip_norm=0.0)  # clipping is done (prepare_step): it does not split groups
            batch = batches.setdefault(update, UpdateBatch())
            placement = state.placement
            if placement is None:  # not banked: its own tensors
                batch.add_adapter(state)
                continue
            key = (id(placement.bank), update, state.optimizer.step)
            runs.setdefault(key, (placement.bank, update, []))[2].append((placement.slot, state))
        for bank, update, members in runs.values():
            for start, run in _consecutive_runs(members):
                if len(run) == 1:  # its own cached views are cheaper than cutting every stack
                    batches[update].add_adapter(run[0])
                else:
                    batches[update].add_rows(bank, start, run)
        for update, batch in batches.items():
            batch.apply(update)
            self.batched_calls += 1


def _consecutive_runs(members: list[tuple[int, AdapterState]]) -> Iterator[tuple[int, list[AdapterState]]]:
    """(first row, states) for each run of consecutive bank rows, in row order."""
    ordered = sorted(members, key=lambda member: member[0])
    start, run = ordered[0][0], [ordered[0][1]]
    for slot, state in ordered[1:]:
        if slot != start + len(run):
            yield start, run
            start, run = slot, []
        run.append(state)
    yield start, run
