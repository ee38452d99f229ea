"""Adapter banks: resident adapters' factors as rows of stacked tensors, read by grouped passes as they are.

Placing, growing and releasing must never change an adapter's values or let two adapters share memory;
a grouped pass over bank rows (consecutive: a view; scattered: a gather; several banks: stacked copies)
must give the same outputs and gradients as plain per-segment autograd.
"""

from __future__ import annotations

import pytest
import torch

from services.domain.training import AdapterId, LoraSpec
from worker.engine import banks as banks_module
from worker.engine.adapters import AdapterState
from worker.engine.banks import AdapterBanks, ClassBank, order_key
from worker.engine.lora import MultiLoraLinear
from worker.engine.passes import LoraWeights, PassContext, PassPlan, Segment

N_IN, N_OUT = 8, 6


def _state(aid: str, seed: int, rank: int = 3) -> AdapterState:
    gen = torch.Generator().manual_seed(seed)
    params = {
        "lin.lora_A": torch.nn.Parameter(torch.randn(rank, N_IN, generator=gen)),
        "lin.lora_B": torch.nn.Parameter(torch.randn(N_OUT, rank, generator=gen)),
    }
    return AdapterState(AdapterId(aid), LoraSpec(rank=rank, seed=seed), seed, params)


def _values(state: AdapterState) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in state.params.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_placed_params_are_bank_rows_with_unchanged_values() -> None:
    banks, states = AdapterBanks(), [_state(f"a{i}", i) for i in range(3)]
    before = [_values(s) for s in states]
    params = [dict(s.params) for s in states]
    for s in states:
        banks.place(s)
    for i, s in enumerate(states):
        _same(_values(s), before[i])
        assert s.placement is not None and s.placement.slot == i
        assert all(s.params[k] is params[i][k] for k in s.params)  # same leaves: optimizer state keyed by them
        bank = s.placement.layers["lin"]
        assert s.params["lin.lora_A"].data_ptr() == bank.A[i].data_ptr()
        assert s.params["lin.lora_B"].data_ptr() == bank.B[i].data_ptr()
    assert [order_key(s) for s in states] == sorted(order_key(s) for s in states)


def test_growing_keeps_every_adapter_and_its_updates() -> None:
    banks, states = AdapterBanks(), [_state(f"a{i}", i) for i in range(9)]  # > initial rows: grows several times
    for s in states:
        banks.place(s)
    with torch.no_grad():
        states[0].params["lin.lora_A"].add_(1.0)  # in-place updates (the optimizer) land in the bank
    expected = _values(states[0])
    bank = states[0].placement.layers["lin"]
    assert torch.equal(bank.A[0], expected["lin.lora_A"])
    assert len({s.params["lin.lora_A"].data_ptr() for s in states}) == len(states)
    assert banks.rows_in_use() == 9


def _placed(count: int) -> tuple[AdapterBanks, list[AdapterState], ClassBank]:
    """`count` adapters placed in order (rows 0, 1, …) and the bank they share."""
    banks, states = AdapterBanks(), [_state(f"a{i}", i) for i in range(count)]
    for s in states:
        banks.place(s)
    placement = states[0].placement
    assert placement is not None
    return banks, states, placement.bank


def test_row_views_are_made_once_per_storage() -> None:
    # Every placement (each restore of a spilled adapter) views the adapter's rows of all four kinds:
    # made anew each time, that was a fifth of a swap. They are made once per bank storage instead.
    banks, states, bank = _placed(2)
    first = bank.rows("", 0)
    assert bank.rows("", 0) is first and bank.rows("grad", 1) is bank.rows("grad", 1)
    banks.place(_state("a2", 2))  # a third row: the bank grows into new storage
    again = dict(bank.rows("", 0))
    assert again is not dict(first)
    assert all(again[k].data_ptr() == p.data_ptr() for k, p in states[0].params.items())
    assert all(again[k].data_ptr() != v.data_ptr() for k, v in first)


def _training_state(s: AdapterState, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    parts = {"grad": grads, "m": s.optimizer.exp_avg, "v": s.optimizer.exp_avg_sq}
    return {f"{kind}:{k}": t.clone() for kind, d in parts.items() for k, t in d.items()}


def test_growing_keeps_pending_gradients_and_moments_in_the_rows() -> None:
    """Adapters placed with a pending gradient and AdamW moments keep both, as row views, across growth."""
    states = [_state(f"a{i}", i) for i in range(9)]
    expected = []
    for i, s in enumerate(states):
        gen = torch.Generator().manual_seed(100 + i)
        for key, p in s.params.items():
            p.grad = torch.randn(p.shape, generator=gen)
            s.optimizer.exp_avg[key] = torch.randn(p.shape, generator=gen)
            s.optimizer.exp_avg_sq[key] = torch.rand(p.shape, generator=gen)
        expected.append(_training_state(s, {k: p.grad for k, p in s.params.items()}))
    banks = AdapterBanks()
    for s in states:
        banks.place(s)  # several growths: every earlier row is copied to new storage
    for s, want in zip(states, expected, strict=True):
        _same(_training_state(s, s.grads()), want)
        layer, slot = s.placement.layers["lin"], s.placement.slot
        assert s.optimizer.exp_avg["lin.lora_A"].data_ptr() == layer.exp_avg_A[slot].data_ptr()
        assert s.grads()["lin.lora_B"].data_ptr() == layer.grad_B[slot].data_ptr()
        assert all(p.grad is None for p in s.params.values())


def test_released_adapter_keeps_its_values_when_the_row_is_reused() -> None:
    banks = AdapterBanks()
    old, new = _state("old", 1), _state("new", 2)
    banks.place(old)
    kept = _values(old)
    slot = old.placement.slot
    banks.release(old)
    banks.place(new)
    assert new.placement.slot == slot  # the freed row is reused...
    _same(_values(old), kept)  # ...without touching the released adapter's values
    assert old.params["lin.lora_A"].data_ptr() != new.params["lin.lora_A"].data_ptr()
    with pytest.raises(RuntimeError, match="bank row"):
        new.to("cpu")  # moving a placed adapter would leave it aliasing a row another may get


def test_ranks_get_their_own_banks() -> None:
    banks = AdapterBanks()
    a, b = _state("a", 1, rank=2), _state("b", 2, rank=4)
    banks.place(a)
    banks.place(b)
    assert a.placement.bank is not b.placement.bank
    assert a.placement.slot == b.placement.slot == 0


def _reference(x: torch.Tensor, segments: list[Segment], n_out: int) -> torch.Tensor:
    pieces = []
    for seg in segments:
        xs, w = x[seg.start:seg.end], seg.weights["lin"]
        pieces.append(((xs @ w.A.t()) @ w.B.t()) * w.scale)
    return torch.cat(pieces)


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], "two-banks"])
def test_grouped_pass_over_bank_rows_equals_per_segment_autograd(order: list[int] | str) -> None:
    """Consecutive rows (a view of the bank), scattered rows (a gather) and two banks (stacked copies)."""
    banks = AdapterBanks()
    ranks = [3, 3, 5] if order == "two-banks" else [3, 3, 3]
    states = [_state(f"a{i}", i, rank=r) for i, r in enumerate(ranks)]
    for s in states:
        banks.place(s)
    picked = [states[i] for i in ([0, 1, 2] if order == "two-banks" else order)]
    weights = [s.layer_weights(trainable=True)["lin"] for s in picked]
    weights = [LoraWeights(w.A, w.B, 0.5 + i, w.bank, w.slot) for i, w in enumerate(weights)]
    segments = [Segment(4 * i, 4 * i + 4, {"lin": w}) for i, w in enumerate(weights)]
    ctx = PassContext(lora_strategy="grouped")
    layer = MultiLoraLinear(torch.nn.Linear(N_IN, N_OUT, bias=False).requires_grad_(False), "lin", ctx)
    x = torch.randn(12, N_IN, requires_grad=True)
    grad_out = torch.randn(12, N_OUT)
    leaves = [x, *(w.A for w in weights), *(w.B for w in weights)]

    with ctx.plan(PassPlan(segments)):
        ours = layer(x) - layer.base(x)
    got = torch.autograd.grad(ours, leaves, grad_out)
    expected_out = _reference(x, segments, N_OUT)
    expected = torch.autograd.grad(expected_out, leaves, grad_out)

    torch.testing.assert_close(ours, expected_out, atol=1e-5, rtol=1e-5)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_placing_an_adapter_copies_each_kind_in_one_call() -> None:
    """Every torch call from Python lets go of the GIL, and on a busy server taking it back waits behind the
    gateway's threads: placing an adapter (every restore of a spilled one) copies its factors, pending
    gradient and moments with one call per kind, not one per tensor. Values are checked above."""
    from torch.overrides import TorchFunctionMode

    class CountCopies(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = getattr(func, "__name__", "")
            self.calls += name in ("copy_", "_foreach_copy_", "zero_", "_foreach_zero_")
            return func(*args, **(kwargs or {}))

    wide = AdapterState(AdapterId("w"), LoraSpec(rank=3, seed=1), 1, {
        f"l{i}.lora_{f}": torch.nn.Parameter(torch.randn(3, N_IN) if f == "A" else torch.randn(N_OUT, 3))
        for i in range(10) for f in "AB"})
    for key, p in wide.params.items():
        p.grad = torch.randn(p.shape)
        wide.optimizer.exp_avg[key] = torch.randn(p.shape)
        wide.optimizer.exp_avg_sq[key] = torch.rand(p.shape)
    counter = CountCopies()
    with counter:
        AdapterBanks().place(wide)
    assert counter.calls <= 4  # factors, gradient, two moments: 80 copies one by one before


def test_sampling_copies_are_banked_apart_so_trainable_rows_stay_consecutive() -> None:
    """Tenants make a sampler copy between training steps; interleaved, the copies would take every other row
    and every packed pass of the trainable adapters would read scattered rows."""
    banks = AdapterBanks()
    trainable, copies = [_state(f"t{i}", i) for i in range(4)], [_state(f"s{i}", 10 + i) for i in range(4)]
    for t, c in zip(trainable, copies, strict=True):
        c.sampling_only = True
        banks.place(t)
        banks.place(c)
    placed = [t.placement for t in trainable]
    assert [p.slot for p in placed if p is not None] == [0, 1, 2, 3]
    assert len({id(p.bank) for p in placed if p is not None}) == 1
    copy_banks = {id(c.placement.bank) for c in copies if c.placement is not None}
    assert len(copy_banks) == 1 and copy_banks.isdisjoint({id(p.bank) for p in placed if p is not None})


def test_runs_of_rows_are_made_once_per_storage() -> None:
    # An optimizer step of many tenants in consecutive rows asks for the same runs (four kinds of one view per
    # factor) every time; made anew, that was about half a millisecond of each eight-tenant step.
    banks, _, bank = _placed(2)
    first = bank.runs("exp_avg", 0, 2)
    assert bank.runs("exp_avg", 0, 2) is first and bank.runs("grad", 0, 2) is not first
    assert [tuple(t.shape) for t in first] == [(2, 3, N_IN), (2, N_OUT, 3)]
    banks.place(_state("a2", 2))  # a third row: the bank grows into new storage
    again = bank.runs("exp_avg", 0, 2)
    assert again is not first
    layer = bank.layers["lin"]
    assert again[0].data_ptr() == layer.exp_avg_A.data_ptr() != first[0].data_ptr()


def test_only_the_most_recent_runs_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # With tenants coming and going the runs of rows differ from step to step: the cache must not grow with them.
    monkeypatch.setattr(banks_module, "_KEPT_RUNS", 2)
    banks, _, bank = _placed(3)
    first = bank.runs("", 0, 2)
    bank.runs("", 1, 3)
    assert bank.runs("", 0, 2) is first  # used again: now the most recent
    bank.runs("", 0, 3)  # a third: the least recently used, (1, 3), goes
    assert bank.runs("", 0, 2) is first
    assert len(bank._runs) == 2
