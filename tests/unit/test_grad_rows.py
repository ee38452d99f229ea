"""Gradient rows: banked adapters' factor gradients written by the pass itself, never through `.grad`.

Against plain autograd on private copies of the same factors, over several passes: consecutive rows (the
batched GEMM writes into them), scattered rows and two banks (per-adapter writes), the loop strategy with
one adapter in two segments of a pass, a tenant stepping (fresh rows) beside tenants still accumulating,
forward-only tenants in a training pass, spilling a pending gradient and taking it back.
"""

from __future__ import annotations

import pytest
import torch

from services.domain.training import AdapterId, LoraSpec
from worker.engine.adapters import AdapterState
from worker.engine.banks import AdapterBanks
from worker.engine.grad_rows import settle
from worker.engine.lora import MultiLoraLinear
from worker.engine.passes import PassContext, PassPlan, Segment

N_IN, N_OUT, SEG = 8, 6, 4


def _state(i: int, rank: int = 3) -> AdapterState:
    gen = torch.Generator().manual_seed(i)
    params = {"lin.lora_A": torch.nn.Parameter(torch.randn(rank, N_IN, generator=gen)),
              "lin.lora_B": torch.nn.Parameter(torch.randn(N_OUT, rank, generator=gen))}
    return AdapterState(AdapterId(f"a{i}"), LoraSpec(rank=rank, alpha=2.0 * (i + 1), seed=i), i, params)


class Reference:
    """Private leaf copies of every adapter's factors, trained by plain autograd alongside."""

    def __init__(self, states: list[AdapterState]) -> None:
        self.leaves = [{k: p.detach().clone().requires_grad_(True) for k, p in s.params.items()} for s in states]
        self.scales = [s.spec.scale for s in states]

    def run(self, x: torch.Tensor, order: list[int], train: list[bool], grad_out: torch.Tensor) -> None:
        pieces = []
        for seg, (i, t) in enumerate(zip(order, train, strict=True)):
            a, b = self.leaves[i]["lin.lora_A"], self.leaves[i]["lin.lora_B"]
            a, b = (a, b) if t else (a.detach(), b.detach())
            pieces.append(((x[seg * SEG:(seg + 1) * SEG] @ a.t()) * self.scales[i]) @ b.t())
        (torch.cat(pieces) * grad_out).sum().backward()

    def grads(self, i: int) -> dict[str, torch.Tensor]:
        return {k: p.grad for k, p in self.leaves[i].items() if p.grad is not None}

    def zero(self, i: int) -> None:
        for p in self.leaves[i].values():
            p.grad = None


def _pass(states: list[AdapterState], x: torch.Tensor, order: list[int], train: list[bool],
          grad_out: torch.Tensor, strategy: str) -> None:
    weights = [states[i].layer_weights(trainable=t) for i, t in zip(order, train, strict=True)]
    segments = [Segment(s * SEG, (s + 1) * SEG, w) for s, w in enumerate(weights)]
    ctx = PassContext(lora_strategy=strategy)
    layer = MultiLoraLinear(torch.nn.Linear(N_IN, N_OUT, bias=False).requires_grad_(False), "lin", ctx)
    plan = PassPlan(segments)
    with ctx.plan(plan):
        out = layer(x)
    (out * grad_out).sum().backward()
    settle([w for w, t in zip(weights, train, strict=True) if t], plan.written)


def _check(states: list[AdapterState], ref: Reference) -> None:
    for i, s in enumerate(states):
        ours, expected = s.grads(), ref.grads(i)
        assert ours.keys() == expected.keys(), s.adapter_id
        for k in ours:
            torch.testing.assert_close(ours[k], expected[k], atol=1e-5, rtol=1e-5)
        assert all(p.grad is None for p in s.params.values())  # banked: the rows hold it, not `.grad`


def _banked(ranks: list[int]) -> list[AdapterState]:
    banks, states = AdapterBanks(), [_state(i, r) for i, r in enumerate(ranks)]
    for s in states:
        banks.place(s)
    return states


@pytest.mark.parametrize("strategy", ["grouped", "loop"])
@pytest.mark.parametrize(("ranks", "order"), [
    ([3, 3, 3], [0, 1, 2]),  # consecutive rows: the batched GEMM writes into them
    ([3, 3, 3], [2, 0, 1]),  # scattered rows
    ([3, 3, 5], [0, 1, 2]),  # two banks (ranks)
    ([3, 3, 3], [0, 1, 0]),  # one adapter in two segments of a pass: the second write adds
])
def test_passes_accumulate_in_rows_and_steps_start_afresh(strategy: str, ranks: list[int], order: list[int]) -> None:
    states = _banked(ranks)
    ref = Reference(states)
    gen = torch.Generator().manual_seed(0)
    train = [True] * len(order)
    for step in range(3):
        tokens = SEG * len(order)
        x, grad_out = torch.randn(tokens, N_IN, generator=gen), torch.randn(tokens, N_OUT, generator=gen)
        _pass(states, x, order, train, grad_out, strategy)
        ref.run(x, order, train, grad_out)
        _check(states, ref)
        if step == 1:  # adapter 0 steps (its rows go stale); the others keep accumulating
            states[0].zero_grad()
            ref.zero(0)
            assert states[0].grads() == {}
    _check(states, ref)


def test_forward_only_tenant_in_a_training_pass_keeps_its_rows_untouched() -> None:
    states = _banked([3, 3, 3])
    ref = Reference(states)
    x, grad_out = torch.randn(3 * SEG, N_IN), torch.randn(3 * SEG, N_OUT)
    _pass(states, x, [0, 1, 2], [True, False, True], grad_out, "grouped")
    ref.run(x, [0, 1, 2], [True, False, True], grad_out)
    assert states[1].grads() == {}
    _check(states, ref)


def test_release_takes_a_pending_gradient_along_and_placing_brings_it_back() -> None:
    banks = AdapterBanks()
    states = [_state(i) for i in range(3)]
    for s in states:
        banks.place(s)
    x, grad_out = torch.randn(3 * SEG, N_IN), torch.randn(3 * SEG, N_OUT)
    _pass(states, x, [0, 1, 2], [True] * 3, grad_out, "grouped")
    pending = {k: g.clone() for k, g in states[1].grads().items()}
    banks.release(states[1])
    assert {k: p.grad for k, p in states[1].params.items()}.keys() == pending.keys()
    for k, p in states[1].params.items():
        assert torch.equal(p.grad, pending[k])
    newcomer = _state(7)
    banks.place(newcomer)  # takes the freed row: its stale values must not read as a gradient
    assert newcomer.grads() == {}
    banks.place(states[1])
    assert all(p.grad is None for p in states[1].params.values())
    for k, g in states[1].grads().items():
        assert torch.equal(g, pending[k])
