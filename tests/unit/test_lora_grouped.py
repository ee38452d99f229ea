"""`GroupedLoraDelta`: the hand-written backward of the grouped multi-LoRA product against autograd.

The engine-level reference tests compare whole passes with peft; these pin the node itself in float64
(gradcheck) and against plain per-segment autograd, including zero-padded ranks, segments of different
lengths (padding rows) and adapters whose factors are detached (forward-only tenants in a training pass).
"""

from __future__ import annotations

import pytest
import torch

from worker.engine import lora_grouped
from worker.engine.lora import MultiLoraLinear
from worker.engine.lora_grouped import GroupedLoraDelta, Layout
from worker.engine.passes import LoraWeights, PassContext, PassPlan, Segment


def _factors(ranks: list[int], n_in: int, n_out: int, dtype: torch.dtype,
             train: list[bool]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(r, n_in, generator=gen, dtype=dtype).requires_grad_(t) for r, t in zip(ranks, train, strict=True)]
    b = [torch.randn(n_out, r, generator=gen, dtype=dtype).requires_grad_(t) for r, t in zip(ranks, train, strict=True)]
    return a + b


def test_gradcheck_mixed_ranks_and_detached_factors() -> None:
    ranks, train = [2, 4, 3], [True, False, True]
    factors = _factors(ranks, n_in=5, n_out=6, dtype=torch.float64, train=train)
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    entries = [(Segment(4 * i, 4 * i + 4, None), LoraWeights(factors[i], factors[len(ranks) + i], scale))
               for i, scale in enumerate([2.0, 0.5, 1.5])]
    layout = Layout(entries, tokens=12, device=x.device, strategy="grouped")
    weights = [w for _, w in entries]
    assert torch.autograd.gradcheck(lambda x_, *f: GroupedLoraDelta.apply(x_, None, layout, None, weights, *f),
                                    (x, *factors))


def _reference(x: torch.Tensor, segments: list[Segment], layer: str, n_out: int) -> torch.Tensor:
    pieces = []
    for seg in segments:
        xs = x[seg.start:seg.end]
        w = seg.weights[layer] if seg.weights else None
        pieces.append(xs.new_zeros(xs.shape[0], n_out) if w is None else ((xs @ w.A.t()) @ w.B.t()) * w.scale)
    return torch.cat(pieces)


@pytest.mark.parametrize("lengths", [[4, 4, 4], [3, 7, 2]])
def test_multi_lora_grouped_equals_per_segment_autograd(lengths: list[int]) -> None:
    n_in, n_out, ranks, train = 8, 6, [2, 4, 3], [True, True, False]
    factors = _factors(ranks, n_in, n_out, torch.float32, train)
    weights = [{"lin": LoraWeights(factors[i], factors[3 + i], 2.0 / (i + 1))} for i in range(3)]
    starts = [sum(lengths[:i]) for i in range(3)]
    segments = [Segment(s, s + n, w) for s, n, w in zip(starts, lengths, weights, strict=True)]
    ctx = PassContext(lora_strategy="grouped")
    layer = MultiLoraLinear(torch.nn.Linear(n_in, n_out, bias=False).requires_grad_(False), "lin", ctx)
    x = torch.randn(sum(lengths), n_in, requires_grad=True)
    grad_out = torch.randn(sum(lengths), n_out)

    with ctx.plan(PassPlan(segments)):
        ours = layer(x) - layer.base(x)
    got = torch.autograd.grad(ours, [x, *factors[:2], *factors[3:5]], grad_out)
    expected_out = _reference(x, segments, "lin", n_out)
    expected = torch.autograd.grad(expected_out, [x, *factors[:2], *factors[3:5]], grad_out)

    torch.testing.assert_close(ours, expected_out, atol=1e-5, rtol=1e-5)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_gradcheck_added_into_the_base_output() -> None:
    """Equal segments covering every token: the node adds the products into the base output in place (one
    GEMM with beta 1 instead of a product and an add); gradients of that output pass through unchanged."""
    ranks, train = [2, 4, 3], [True, False, True]
    factors = _factors(ranks, n_in=5, n_out=6, dtype=torch.float64, train=train)
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(12, 6, dtype=torch.float64, requires_grad=True)
    entries = [(Segment(4 * i, 4 * i + 4, None), LoraWeights(factors[i], factors[len(ranks) + i], scale))
               for i, scale in enumerate([2.0, 0.5, 1.5])]
    layout = Layout(entries, tokens=12, device=x.device, strategy="grouped")
    weights = [w for _, w in entries]
    assert layout.uniform

    def added(x_: torch.Tensor, y_: torch.Tensor, *f: torch.Tensor) -> torch.Tensor:
        return GroupedLoraDelta.apply(x_, y_.clone(), layout, None, weights, *f)

    assert torch.autograd.gradcheck(added, (x, y, *factors))
    separate = y + GroupedLoraDelta.apply(x, None, layout, None, weights, *factors).reshape(12, 6)
    torch.testing.assert_close(added(x, y, *factors), separate)


def test_the_input_gradient_is_summed_with_the_base_gradient_in_place() -> None:
    """Equal segments covering every token (the service's many tenants of one length): the node takes the
    layer's (tokens, in) input itself and hands back its gradient as a tensor of its own, not a view of a
    per-segment one, so autograd adds the base GEMM's gradient of the same input into it in place instead of
    allocating a sum (an `aten::add` of (tokens, in) per layer, about 1 % of a pass of eight tenants)."""
    n_in, n_out, count, length = 8, 6, 3, 4
    factors = _factors([2] * count, n_in, n_out, torch.float32, [True] * count)
    weights = [{"lin": LoraWeights(factors[i], factors[count + i], 1.0)} for i in range(count)]
    segments = [Segment(length * i, length * (i + 1), w) for i, w in enumerate(weights)]
    ctx = PassContext(lora_strategy="grouped")
    layer = MultiLoraLinear(torch.nn.Linear(n_in, n_out, bias=False).requires_grad_(False), "lin", ctx)
    x0 = torch.randn(count * length, n_in, requires_grad=True)
    with ctx.plan(PassPlan(segments)):
        out = layer(x0 * 2.0)  # an input with a grad_fn, like a layer's normalised hidden states
    with torch.profiler.profile(record_shapes=True) as prof:
        out.sum().backward()
    shape = [count * length, n_in]
    summed = [(e.key, e.input_shapes) for e in prof.events() if e.key in ("aten::add", "aten::add_")
              and e.input_shapes[:2] == [shape, shape]]
    assert summed == [("aten::add_", [shape, shape, []])]
    expected = torch.autograd.grad(((x0 * 2.0) @ layer.base.weight.t() + _reference(x0 * 2.0, segments, "lin", n_out)
                                    ).sum(), x0)[0]
    torch.testing.assert_close(x0.grad, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("copy_limit", [lora_grouped.DECODE_COPY_LIMIT, 0])
@pytest.mark.parametrize("lengths", [[4, 4, 4], [3, 1, 2]])
def test_decode_steps_without_grad_equal_the_per_segment_products(lengths: list[int], copy_limit: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step (no grad, a few rows per segment) runs on operands made once per plan: A scaled and B laid
    out contiguously (B's stack within the copy limit; past it, through B's view). Every step of the plan must
    give each segment its own adapter's delta, added into the base output in place when the segments cover it
    end to end."""
    monkeypatch.setattr(lora_grouped, "DECODE_COPY_LIMIT", copy_limit)
    n_in, n_out, ranks = 8, 6, [2, 4, 3]
    factors = _factors(ranks, n_in, n_out, torch.float32, [False] * 3)
    weights = [{"lin": LoraWeights(factors[i], factors[3 + i], 2.0 / (i + 1))} for i in range(3)]
    starts = [sum(lengths[:i]) for i in range(3)]
    segments = [Segment(s, s + n, w) for s, n, w in zip(starts, lengths, weights, strict=True)]
    ctx = PassContext(lora_strategy="grouped")
    layer = MultiLoraLinear(torch.nn.Linear(n_in, n_out, bias=False).requires_grad_(False), "lin", ctx)
    plan = PassPlan(segments)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(3):  # the steps of one plan: the second and third reuse the first's operands
            x = torch.randn(sum(lengths), n_in, generator=gen)
            with ctx.plan(plan):
                ours = layer(x) - layer.base(x)
            torch.testing.assert_close(ours, _reference(x, segments, "lin", n_out), atol=1e-5, rtol=1e-5)
    route = plan.routes["lin"]
    if copy_limit:
        assert route.decode is not None and route.decode[1].is_contiguous()  # type: ignore[attr-defined]
    else:
        assert route.decode is None  # type: ignore[attr-defined]
