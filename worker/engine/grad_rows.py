"""Where a multi-LoRA pass puts factor gradients: a banked adapter's into its bank's gradient rows.

Resident adapters keep their factors in banks (worker/engine/banks.py) and their gradients beside them,
in gradient rows of the same shape. The backward of a grouped pass computes every segment's factor
gradient in one batched GEMM; when the segments' adapters sit in consecutive rows of one bank, that GEMM
writes straight into their gradient rows (`out=`, or adding with `baddbmm_` when they already hold a
gradient). Autograd never sees those gradients: no per-adapter views, no `AccumulateGrad` per factor
and no fresh gradient memory on every pass, which with many tenants in small passes was about a twentieth
of a step. Each adapter's gradient still only ever comes from its own segments' rows.

A row is *fresh* when it holds nothing to keep: its adapter's `GradRows.valid` is unset (no pass since
its last optimizer step) and this pass has not written it yet (`PassPlan.written`). A fresh row is
overwritten, any other is added to, so an optimizer step never has to zero gradients. Factors outside
any bank (tests, or a layer an adapter does not train) get their gradient back through autograd, as
before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import torch

from worker.engine.passes import LoraWeights
from worker.engine.rank_gemm import rank_product, write_product

Factor = Literal["A", "B"]


def deliver_stacked(operands: tuple[torch.Tensor, torch.Tensor], weights: Sequence[LoraWeights],
                    needs: Sequence[bool], first_slot: int | None, factor: Factor,
                    written: set[tuple[int, int]], slots: torch.Tensor | None = None) -> list[torch.Tensor | None]:
    """Gradients `bmm(*operands)` (one row per segment) of every segment's `factor`: written into the
    gradient rows of banked adapters, returned (rank padding cut off) for the others, None where a
    segment's factor does not train. `slots`: the segments' rows of their shared bank, when not consecutive."""
    stack = _grad_stack(weights[0], factor)
    one_bank = stack is not None and all(needs) and _one_bank(weights)
    if one_bank and first_slot is not None:
        assert stack is not None
        rows = stack[first_slot : first_slot + len(weights)]
        _write_rows(operands, rows, stack, weights, first_slot, written)
        return [None] * len(weights)
    stacked = rank_product(*operands)
    if one_bank and slots is not None and _scatterable(stacked, stack, weights):
        assert stack is not None
        _scatter_rows(stacked, stack, weights, slots, written)
        return [None] * len(weights)
    return [_deliver(stacked[i], w, factor, written) if need else None
            for i, (w, need) in enumerate(zip(weights, needs, strict=True))]


def _one_bank(weights: Sequence[LoraWeights]) -> bool:
    """Every segment's factors (and so their gradient rows) in the first one's bank."""
    bank = weights[0].bank
    return all(w.bank is bank and w.grad_rows is not None for w in weights)


def _scatterable(stacked: torch.Tensor, stack: torch.Tensor | None, weights: Sequence[LoraWeights]) -> bool:
    """One indexed write fits: no rank padding to cut, and every segment its own row (an adapter in two
    segments of a pass must add its second gradient to its first)."""
    return (stack is not None and stacked.shape[1:] == stack.shape[1:]
            and len({w.slot for w in weights}) == len(weights))


def _scatter_rows(stacked: torch.Tensor, stack: torch.Tensor, weights: Sequence[LoraWeights],
                  slots: torch.Tensor, written: set[tuple[int, int]]) -> None:
    """Scattered rows of one bank in one indexed op instead of a copy per adapter: with a pass holding a
    few of many resident tenants (the usual case in a service) their rows are rarely consecutive, and the
    per-adapter Python was about a seventh of the loop thread's time."""
    fresh = [_fresh(stack, w, w.slot, written) for w in weights]
    if all(fresh):
        stack.index_copy_(0, slots, stacked)
    else:
        for w in (w for w, f in zip(weights, fresh, strict=True) if f):
            stack[w.slot].zero_()
        stack.index_add_(0, slots, stacked)
    written.update((id(stack), w.slot) for w in weights)


def deliver_one(operands: tuple[torch.Tensor, torch.Tensor], w: LoraWeights, factor: Factor,
                written: set[tuple[int, int]]) -> torch.Tensor | None:
    """Gradient `mm(*operands)` of one adapter's `factor`: into its gradient row when banked, else returned."""
    stack = _grad_stack(w, factor)
    if stack is None:
        return rank_product(*operands)
    write_product(*operands, stack[w.slot], accumulate=not _fresh(stack, w, w.slot, written))
    written.add((id(stack), w.slot))
    return None


def _write_rows(operands: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, stack: torch.Tensor,
                weights: Sequence[LoraWeights], first_slot: int, written: set[tuple[int, int]]) -> None:
    fresh = [_fresh(stack, w, first_slot + i, written) for i, w in enumerate(weights)]
    accumulate = not all(fresh)
    if accumulate:  # rows written earlier in the pass add to what they hold; the fresh ones start from zero
        for i in (i for i, f in enumerate(fresh) if f):
            rows[i].zero_()
    write_product(*operands, rows, accumulate=accumulate)
    written.update((id(stack), slot) for slot in range(first_slot, first_slot + len(weights)))


def _deliver(grad: torch.Tensor, w: LoraWeights, factor: Factor,
             written: set[tuple[int, int]]) -> torch.Tensor | None:
    rank = w.A.shape[0]
    grad = grad.narrow(0 if factor == "A" else 1, 0, rank)  # cut a zero-padded rank
    stack = _grad_stack(w, factor)
    if stack is None:
        return grad
    row = stack[w.slot]
    if _fresh(stack, w, w.slot, written):
        row.copy_(grad)
    else:
        row.add_(grad)
    written.add((id(stack), w.slot))
    return None


def _fresh(stack: torch.Tensor, w: LoraWeights, slot: int, written: set[tuple[int, int]]) -> bool:
    assert w.grad_rows is not None
    return not w.grad_rows.valid and (id(stack), slot) not in written


def _grad_stack(w: LoraWeights, factor: Factor) -> torch.Tensor | None:
    if w.bank is None or w.grad_rows is None:
        return None
    return w.bank.grad_A if factor == "A" else w.bank.grad_B


def settle(trained: Iterable[Mapping[str, LoraWeights]], written: set[tuple[int, int]]) -> None:
    """After a pass's backward: every trained banked adapter now holds a gradient in its rows. A fresh
    row the pass did not reach (a layer whose output the loss ignores) is zeroed rather than left stale."""
    for weights in trained:
        first = next(iter(weights.values()), None)
        if first is None or first.grad_rows is None or first.grad_rows.valid:
            continue
        for w in weights.values():
            for stack in (_grad_stack(w, "A"), _grad_stack(w, "B")):
                if stack is not None and (id(stack), w.slot) not in written:
                    stack[w.slot].zero_()
        first.grad_rows.valid = True
