"""`GradGuard`: a `forward_backward` call that raises leaves every adapter's gradient as it found it.

A call runs as several micro-batches (packed passes); each one's backward adds to the trained adapters'
gradients (bank gradient rows, worker/engine/grad_rows.py, or `.grad` for unbanked factors). When a later
micro-batch raises (an allocation only one tenant's data needs, a bug), the dispatcher re-runs the call's
requests one by one (services/runtime/dispatch.py). Gradients the earlier micro-batches already added would
then count twice, and a tenant whose request fails on its own would keep a gradient from data it was told
failed: training in a shared pass would no longer equal training alone.

The guard is taken before the first micro-batch and restored if the call raises. It costs nothing in the
common case: an adapter whose gradient rows hold nothing to keep (no pass since its last optimizer step,
`GradRows.valid` unset) needs no copy, only its flag reset, because a row that is not valid is overwritten
by the next pass anyway. Only an adapter accumulating over several calls before a step has its gradient
copied (one clone per factor, the size of its LoRA factors).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from worker.engine.adapters import AdapterState


@dataclass
class _Saved:
    state: AdapterState
    valid: bool
    """The bank rows' `GradRows.valid` before the call (placed adapters)."""
    grads: dict[str, torch.Tensor | None]
    """Copies of what must come back: valid bank rows, or every `.grad` of an unplaced adapter."""


class GradGuard:
    """The gradients of the adapters one call trains, as they were before it; `restore()` puts them back."""

    def __init__(self, trained: Iterable[AdapterState]) -> None:
        self._saved = [_save(state) for state in trained]

    def restore(self) -> None:
        """Undo whatever the call's passes added to the guarded adapters' gradients."""
        with torch.no_grad():
            for saved in self._saved:
                _restore(saved)


def _save(state: AdapterState) -> _Saved:
    if state.placement is None:
        grads = {k: (None if p.grad is None else p.grad.detach().clone()) for k, p in state.params.items()}
        return _Saved(state, False, grads)
    valid = state.grad_rows.valid
    copies: dict[str, torch.Tensor | None] = {k: g.clone() for k, g in state.grads().items()} if valid else {}
    return _Saved(state, valid, copies)


def _restore(saved: _Saved) -> None:
    state = saved.state
    if state.placement is None:
        for key, p in state.params.items():
            p.grad = saved.grads.get(key)
        return
    rows = state.placement.grads()
    for key, copy in saved.grads.items():
        if copy is not None:
            rows[key].copy_(copy)
    # Not valid before: the rows' contents are void again and the next pass overwrites them.
    state.grad_rows.valid = saved.valid
