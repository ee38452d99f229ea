"""Multi-LoRA linear layers: one frozen base GEMM over all tokens, then each segment's own low-rank delta.

`MultiLoraLinear` wraps a model's `nn.Linear`; which adapter serves which tokens comes from the shared
`PassContext`, so one forward pass can serve many tenants' adapters of different ranks. Each adapter's
factors are separate autograd leaves, so a summed loss gives each adapter exactly its own gradient.

Two ways to compute the deltas, same result, both added into the base GEMM's output:
- `loop`: per segment, scale * (x_seg @ A.T) @ B.T: two small GEMMs per segment.
- `grouped` (worker/engine/lora_grouped.py): all segments' products as one pair of batched GEMMs over
  padded segments and zero-padded ranks, the factors read straight from their banks. `auto` picks per layer
  and pass with a small cost model (group unless padding wastes more than half the LoRA FLOPs).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from worker.engine.grad_rows import deliver_one
from worker.engine.lora_grouped import Route, add_grouped_deltas, layout_for, plus
from worker.engine.passes import LoraWeights, PassContext, PassPlan, Segment
from worker.engine.rank_gemm import rank_product

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGETS = ("lm_head",)
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS + UNEMBED_TARGETS


class MultiLoraLinear(nn.Module):
    """A frozen `nn.Linear` plus per-segment LoRA deltas read from the current pass plan."""

    def __init__(self, base: nn.Linear, name: str, ctx: PassContext) -> None:
        super().__init__()
        self.base = base
        self.layer_name = name
        # Read in every forward: a plain attribute, where `self.base.…` goes through `Module.__getattr__`.
        self._out_features: int = base.out_features
        # A plain attribute, not a submodule: the context is shared by every layer of the model.
        object.__setattr__(self, "_ctx", ctx)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self._out_features

    @property
    def weight(self) -> torch.Tensor:
        # transformers ties/inspects `lm_head.weight`; expose the frozen base weight.
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self._ctx.current
        if plan is None:
            return self.base(x)
        x2 = x.reshape(-1, x.shape[-1])
        route = plan.routes.get(self.layer_name)
        if route is None:
            route = plan.routes[self.layer_name] = _route(plan, self.layer_name, x2, self._ctx.lora_strategy)
        assert isinstance(route, Route)
        if not route.entries:
            return self.base(x)
        # The base output of the flattened tokens: a tensor of its own (not a view), so the deltas can be
        # added into it in place by their last GEMM (`addmm_`/`baddbmm_` with beta 1) instead of a separate
        # pass over the (tokens, out) output (about 4 % of a small model's pass on CPU; on a GPU it is a
        # memory-bound read of two outputs and a write per layer).
        y = self.base(x2)
        if route.layout is not None and route.layout.grouped:
            out = add_grouped_deltas(x2, y, route, self.out_features)
        else:
            out = self._looped(x2, y, route.entries, plan)
        return out.view(*x.shape[:-1], self.out_features)

    def _looped(self, x: torch.Tensor, y: torch.Tensor, entries: list[tuple[Segment, LoraWeights]],
                plan: PassPlan) -> torch.Tensor:
        """`y` plus every segment's delta, one segment at a time."""
        segments = plan.segments
        if len(entries) == 1 and len(segments) == 1:
            _, w = entries[0]
            return _delta(x, w, plan.written, into=y)
        by_start = {seg.start: w for seg, w in entries}
        # `split` (not slicing): its backward is one concatenation, where each slice's backward would
        # materialise a zero-filled gradient of the whole input.
        parts = x.split([seg.end - seg.start for seg in segments])
        pieces: list[torch.Tensor] = []
        for seg, xs in zip(segments, parts, strict=True):
            w = by_start.get(seg.start)
            if w is None:
                pieces.append(x.new_zeros((seg.end - seg.start, self.out_features)))
                continue
            pieces.append(_delta(xs, w, plan.written))
        return plus(y, torch.cat(pieces, dim=0))


def _delta(x: torch.Tensor, w: LoraWeights, written: set[tuple[int, int]],
           into: torch.Tensor | None = None) -> torch.Tensor:
    """scale * (x @ A.T) @ B.T; with `into` (the layer's base output), `into` plus it, added by the second
    GEMM (in place where nothing records the graph, or through `LoraDelta`)."""
    x = x.to(w.A.dtype)
    if into is not None and into.dtype != w.A.dtype:
        return plus(into, _delta(x, w, written))
    if w.grad_rows is not None and torch.is_grad_enabled() and w.A.requires_grad:
        return LoraDelta.apply(x, into, w, written, w.A, w.B)
    # Scale the (tokens, rank) product, not the (tokens, out) one: lm_head's out is the vocabulary.
    h = rank_product(x, w.A.t()) * w.scale
    if into is None:
        return h @ w.B.t()
    return torch.addmm(into, h, w.B.t()) if torch.is_grad_enabled() else into.addmm_(h, w.B.t())


class LoraDelta(torch.autograd.Function):
    """scale * (x @ A.T) @ B.T for one banked adapter, or `into` plus it (added in place by the second GEMM):
    autograd's own four GEMMs, but the factors' gradients go to the adapter's gradient rows
    (worker/engine/grad_rows.py) instead of `.grad`."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, into: torch.Tensor | None,
                w: LoraWeights, written: set[tuple[int, int]], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = rank_product(x, a.t()) * w.scale
        ctx.save_for_backward(x, h, a, b)
        ctx.weights, ctx.written = w, written
        if into is None:
            return h @ b.t()
        ctx.mark_dirty(into)
        return into.addmm_(h, b.t())

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, h, a, b = ctx.saved_tensors
        w: LoraWeights = ctx.weights
        needs = ctx.needs_input_grad
        grad_h = rank_product(grad_out, b) * w.scale
        grad_x = grad_h @ a if needs[0] else None
        grad_a = deliver_one((grad_h.t(), x), w, "A", ctx.written) if needs[4] else None
        grad_b = deliver_one((grad_out.t(), h), w, "B", ctx.written) if needs[5] else None
        return grad_x, grad_out if needs[1] else None, None, None, grad_a, grad_b


def _route(plan: PassPlan, layer: str, x2: torch.Tensor, strategy: str) -> Route:
    entries = [(seg, w) for seg in plan.segments if (w := _weights(seg, layer)) is not None]
    layout = None
    if entries and (strategy == "grouped" or (strategy == "auto" and len(entries) > 1)):
        layout = layout_for(plan, entries, x2.shape[0], x2.device, strategy)
    return Route(entries, layout)


def _weights(seg: Segment, layer: str) -> LoraWeights | None:
    return seg.weights.get(layer) if seg.weights is not None else None


def target_suffixes(train_attn: bool, train_mlp: bool, train_unembed: bool) -> tuple[str, ...]:
    return (
        (ATTN_TARGETS if train_attn else ())
        + (MLP_TARGETS if train_mlp else ())
        + (UNEMBED_TARGETS if train_unembed else ())
    )


def inject_multi_lora(model: nn.Module, ctx: PassContext) -> dict[str, MultiLoraLinear]:
    """Replace every targetable `nn.Linear` by a `MultiLoraLinear`; return them by module name."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and _is_target(n)]
    layers: dict[str, MultiLoraLinear] = {}
    for name, linear in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapped = MultiLoraLinear(linear, name, ctx)
        setattr(parent, child, wrapped)
        layers[name] = wrapped
    if not layers:
        raise ValueError("no LoRA-targetable linear layers found (expected q/k/v/o, gate/up/down, lm_head)")
    return layers


def _is_target(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ALL_TARGETS


def iter_targets(layers: dict[str, MultiLoraLinear], suffixes: tuple[str, ...]) -> Iterator[MultiLoraLinear]:
    """Layers an adapter with these target suffixes trains, in a stable (sorted) order."""
    for name in sorted(layers):
        if name.rsplit(".", 1)[-1] in suffixes:
            yield layers[name]
