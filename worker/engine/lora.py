"""Multi-LoRA linear layers: one frozen base GEMM over all tokens, then each segment's own low-rank delta.

`MultiLoraLinear` wraps a model's `nn.Linear`; which adapter serves which tokens comes from the shared
`PassContext`, so one forward pass can serve many tenants' adapters of different ranks. Each adapter's
factors are separate autograd leaves, so a summed loss gives each adapter exactly its own gradient.

Two ways to compute the deltas, same result:
- `loop`: per segment, scale * (x_seg @ A.T) @ B.T: two small GEMMs per segment.
- `grouped`: the segments padded to one length (and the factors to one rank, with zeros) and stacked,
  so every adapter's product is one batched GEMM (`bmm`) pair: a handful of ops whatever the number
  of tenants, wasting only the padding. With many small segments (the RL regime) per-op overhead
  dominates, which is what grouping removes. `auto` picks per layer and pass with a small cost model.
  Resident adapters' factors already live stacked in banks (worker/engine/banks.py): adapters in
  consecutive bank rows are read as a view, others with one gather; only adapters from different
  banks (ranks) are copied together.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from worker.engine.grad_rows import deliver_one, deliver_stacked
from worker.engine.passes import LoraWeights, PassContext, PassPlan, Segment

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGETS = ("lm_head",)
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS + UNEMBED_TARGETS

# `auto` groups when padding wastes at most this fraction of the LoRA FLOPs. Grouping always saves
# ops (2 GEMMs per segment become 2 batched GEMMs), so only heavy padding makes the loop worthwhile.
_MAX_PADDING_WASTE = 0.5


class MultiLoraLinear(nn.Module):
    """A frozen `nn.Linear` plus per-segment LoRA deltas read from the current pass plan."""

    def __init__(self, base: nn.Linear, name: str, ctx: PassContext) -> None:
        super().__init__()
        self.base = base
        self.layer_name = name
        # A plain attribute, not a submodule: the context is shared by every layer of the model.
        object.__setattr__(self, "_ctx", ctx)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

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
        assert isinstance(route, _Route)
        if not route.entries:
            return self.base(x)
        # The base output of the flattened tokens: a tensor of its own (not a view), so the deltas can be
        # added into it in place by their last GEMM (`addmm_`/`baddbmm_` with beta 1) instead of a separate
        # pass over the (tokens, out) output (about 4 % of a small model's pass on CPU; on a GPU it is a
        # memory-bound read of two outputs and a write per layer).
        y = self.base(x2)
        if route.layout is not None and route.layout.grouped:
            out = _grouped(x2, y, route, self.out_features)
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
        return _plus(y, torch.cat(pieces, dim=0))


def _plus(y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return y + delta.to(y.dtype)


def _delta(x: torch.Tensor, w: LoraWeights, written: set[tuple[int, int]],
           into: torch.Tensor | None = None) -> torch.Tensor:
    """scale * (x @ A.T) @ B.T; with `into` (the layer's base output), `into` plus it, added by the second
    GEMM (in place where nothing records the graph, or through `LoraDelta`)."""
    x = x.to(w.A.dtype)
    if into is not None and into.dtype != w.A.dtype:
        return _plus(into, _delta(x, w, written))
    if w.grad_rows is not None and torch.is_grad_enabled() and w.A.requires_grad:
        return LoraDelta.apply(x, into, w, written, w.A, w.B)
    # Scale the (tokens, rank) product, not the (tokens, out) one: lm_head's out is the vocabulary.
    h = (x @ w.A.t()) * w.scale
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
        h = (x @ a.t()) * w.scale
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
        grad_h = (grad_out @ b) * w.scale
        grad_x = grad_h @ a if needs[0] else None
        grad_a = deliver_one((grad_h.t(), x), w, "A", ctx.written) if needs[4] else None
        grad_b = deliver_one((grad_out.t(), h), w, "B", ctx.written) if needs[5] else None
        return grad_x, grad_out if needs[1] else None, None, None, grad_a, grad_b


class _Route:
    """One layer's share of a pass plan (`PassPlan.routes`): the segments it serves with their factors, the
    grouped layout when one applies, and (inference only) those factors stacked."""

    def __init__(self, entries: list[tuple[Segment, LoraWeights]], layout: _Layout | None) -> None:
        self.entries = entries
        self.weights = [w for _, w in entries]
        self.layout = layout
        self.stacks: tuple[torch.Tensor, torch.Tensor] | None = None
        """Without grad, the factors stacked and transposed for the two batched GEMMs (A as (S, in, R), B as
        (S, R, out)), kept for the plan's later calls: the decode steps of a sample batch (one plan while no
        row leaves) find them here instead of slicing the banks again in every layer and step."""


def _route(plan: PassPlan, layer: str, x2: torch.Tensor, strategy: str) -> _Route:
    entries = [(seg, w) for seg in plan.segments if (w := _weights(seg, layer)) is not None]
    layout = None
    if entries and (strategy == "grouped" or (strategy == "auto" and len(entries) > 1)):
        layout = _layout(plan, entries, x2.shape[0], x2.device, strategy)
    return _Route(entries, layout)


def _grouped(x: torch.Tensor, y: torch.Tensor, route: _Route, out_features: int) -> torch.Tensor:
    """`y` plus all segments' deltas, with two batched GEMMs over padded segments and zero-padded ranks."""
    layout, weights = route.layout, route.weights
    assert layout is not None
    dtype = weights[0].A.dtype
    # Equal segments covering every token: the second GEMM adds into `y` itself (viewed per segment).
    into = y if layout.uniform and y.dtype == dtype else None
    if layout.uniform:
        # A view, no gather and no scatter.
        x_S_L_in = x.to(dtype).view(len(weights), -1, x.shape[1])
    else:
        x_ext = torch.cat([x.to(dtype), x.new_zeros((1, x.shape[1]), dtype=dtype)])  # row T: padding source
        x_S_L_in = x_ext[layout.gather]
    if not torch.is_grad_enabled():
        out_S_L_out = _grouped_inference(x_S_L_in, into, route)
    else:
        out_S_L_out = _grouped_with_graph(x_S_L_in, into, layout, _bank_stacks(weights, layout), weights)
    if into is not None:
        return out_S_L_out  # `y`, deltas added
    if layout.uniform:
        return _plus(y, out_S_L_out.reshape(-1, out_features))
    picked = out_S_L_out.reshape(-1, out_features)[layout.valid].to(y.dtype)
    if layout.covers_all:
        return y + picked
    if not torch.is_grad_enabled():
        return y.index_add_(0, layout.positions, picked)
    return y.index_add(0, layout.positions, picked)  # rows outside every segment keep the base output


def _grouped_inference(x_S_L_in: torch.Tensor, into: torch.Tensor | None, route: _Route) -> torch.Tensor:
    """The grouped product without grad (sampling): no graph to build, so no autograd node either; its `apply`
    machinery was as costly as the two GEMMs themselves on a decode step of a few rows per adapter."""
    layout, weights = route.layout, route.weights
    assert layout is not None
    if route.stacks is None:
        a_S_R_in, b_S_out_R = _bank_stacks(weights, layout) or (
            _stack([w.A for w in weights], layout.rank, dim=0), _stack([w.B for w in weights], layout.rank, dim=1))
        route.stacks = a_S_R_in.transpose(1, 2), b_S_out_R.transpose(1, 2)
    a_S_in_R, b_S_R_out = route.stacks
    h_S_L_R = torch.bmm(x_S_L_in, a_S_in_R).mul_(layout.scale)
    if into is None:
        return torch.bmm(h_S_L_R, b_S_R_out)
    into.view(len(weights), -1, into.shape[1]).baddbmm_(h_S_L_R, b_S_R_out)
    return into


def _grouped_with_graph(x_S_L_in: torch.Tensor, into: torch.Tensor | None, layout: _Layout,
                        stacks: tuple[torch.Tensor, torch.Tensor] | None, weights: list[LoraWeights]) -> torch.Tensor:
    """The grouped product as one autograd node (grad is on)."""
    if stacks is not None and all(w.grad_rows is not None for w in weights):
        # Gradients go to bank rows: autograd only needs to know whether anything here trains.
        inputs = [layout.trigger()] if any(w.A.requires_grad for w in weights) else []
    else:
        inputs = [w.A for w in weights] + [w.B for w in weights]
    return GroupedLoraDelta.apply(x_S_L_in, into, layout, stacks, weights, *inputs)


def _grouped_product(x_S_L_in: torch.Tensor, into: torch.Tensor | None, a_S_R_in: torch.Tensor,
                     b_S_out_R: torch.Tensor, scale_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, out): h = scale_s * x_s @ A_s.T, out = h @ B_s.T for every segment s, as two batched GEMMs; with
    `into` ((S * L, out), segments end to end), out is `into` with h @ B_s.T added in place."""
    h_S_L_R = torch.bmm(x_S_L_in, a_S_R_in.transpose(1, 2)).mul_(scale_S)
    if into is None:
        return h_S_L_R, torch.bmm(h_S_L_R, b_S_out_R.transpose(1, 2))
    into.view(x_S_L_in.shape[0], -1, into.shape[1]).baddbmm_(h_S_L_R, b_S_out_R.transpose(1, 2))
    return h_S_L_R, into


class GroupedLoraDelta(torch.autograd.Function):
    """scale_s * (x_s @ A_s.T) @ B_s.T for every segment s, as one autograd node with a hand-written backward;
    given `into` (the layer's base output, segments end to end), `into` with the products added in place.

    The same four batched GEMMs autograd would run, without its bookkeeping around them: no stack/unbind
    nodes for the factors, no separate scaling node, and the factors' gradients written by the batched GEMM
    straight into the adapters' gradient rows when they are banked (worker/engine/grad_rows.py; others get
    theirs back through autograd). With many tenants and small segments those per-op costs were as large as
    the GEMMs themselves. Gradients are computed only for the inputs that need them (a forward-only
    tenant's factors are detached).
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x_S_L_in: torch.Tensor, into: torch.Tensor | None,
                layout: _Layout, stacks: tuple[torch.Tensor, torch.Tensor] | None, weights: list[LoraWeights],
                *factors: torch.Tensor) -> torch.Tensor:
        # `factors` are the autograd inputs: each adapter's leaves, or (all adapters banked, their
        # gradients going to bank rows) at most one trigger leaf that puts this node in the graph.
        # `stacks`, when given, hold the factors already stacked (rows of the adapters' bank).
        count = len(weights)
        ctx.trains = None if len(factors) == 2 * count else tuple(w.A.requires_grad for w in weights)
        if stacks is None:
            stacks = (_stack(list(factors[:count]), layout.rank, dim=0),
                      _stack(list(factors[count:]), layout.rank, dim=1))
        a_S_R_in, b_S_out_R = stacks
        h_S_L_R, out = _grouped_product(x_S_L_in, into, a_S_R_in, b_S_out_R, layout.scale)
        ctx.save_for_backward(x_S_L_in, h_S_L_R, a_S_R_in, b_S_out_R)
        ctx.layout, ctx.weights = layout, weights
        if into is not None:
            ctx.mark_dirty(into)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_S_L_in, h_S_L_R, a_S_R_in, b_S_out_R = ctx.saved_tensors
        layout: _Layout = ctx.layout
        weights: list[LoraWeights] = ctx.weights
        count = len(weights)
        if ctx.trains is None:
            needs = ctx.needs_input_grad
            needs_a, needs_b = needs[_FACTORS : _FACTORS + count], needs[_FACTORS + count :]
        else:
            needs_a = needs_b = ctx.trains
        grad_S_L_out = grad_out.contiguous().view(x_S_L_in.shape[0], x_S_L_in.shape[1], -1)
        grad_x: torch.Tensor | None = None
        grads_a: list[torch.Tensor | None] = [None] * count
        grads_b: list[torch.Tensor | None] = [None] * count
        if ctx.needs_input_grad[0] or any(needs_a):  # both go through the gradient of the low-rank activations
            grad_h = torch.bmm(grad_S_L_out, b_S_out_R).mul_(layout.scale)
            grad_x = torch.bmm(grad_h, a_S_R_in) if ctx.needs_input_grad[0] else None
            if any(needs_a):
                grads_a = deliver_stacked((grad_h.transpose(1, 2), x_S_L_in), weights, needs_a, layout.first_slot,
                                          "A", layout.written, layout.slots)
        if any(needs_b):
            grads_b = deliver_stacked((grad_S_L_out.transpose(1, 2), h_S_L_R), weights, needs_b, layout.first_slot,
                                      "B", layout.written, layout.slots)
        factor_grads = (*grads_a, *grads_b) if ctx.trains is None else (None,) * (len(ctx.needs_input_grad) - _FACTORS)
        grad_into = grad_out if ctx.needs_input_grad[1] else None  # the added-to base output passes through
        return (grad_x, grad_into, None, None, None, *factor_grads)


_FACTORS = 5
"""Position of the first factor among `GroupedLoraDelta.apply`'s inputs (x, into, layout, stacks, weights,
*factors)."""


def _bank_stacks(weights: list[LoraWeights], layout: _Layout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The segments' factors straight from their shared bank: a view when their rows are consecutive,
    otherwise one gather. None when they are not all in one bank (the caller stacks them)."""
    bank = weights[0].bank
    if bank is None or any(w.bank is not bank for w in weights):
        return None
    first = layout.first_slot
    if first is not None:
        return bank.A[first : first + len(weights)], bank.B[first : first + len(weights)]
    # Keyed by the stacks' storage as well: a bank that grew has new tensors (a shared dict never outlives
    # a sample batch, whose adapters stay pinned, but a stale gather must not be possible at all).
    key = (id(bank.A), bank.A.data_ptr(), bank.B.data_ptr(), *(w.slot for w in weights))
    cached = layout.gathered.get(key) if layout.gathered is not None else None
    if cached is not None:
        return cached  # type: ignore[return-value]
    if layout.slots is None:
        layout.slots = torch.tensor([w.slot for w in weights], device=bank.A.device)
    stacks = bank.A.index_select(0, layout.slots), bank.B.index_select(0, layout.slots)
    if layout.gathered is not None:
        layout.gathered[key] = stacks
    return stacks


def _stack(factors: list[torch.Tensor], rank: int, dim: int) -> torch.Tensor:
    """Stack factors along a new leading axis, zero-padding the rank axis (`dim`) up to `rank`."""
    if all(f.shape[dim] == rank for f in factors):
        return torch.stack(factors)
    padded = []
    for f in factors:
        missing = rank - f.shape[dim]
        pad = (0, 0, 0, missing) if dim == 0 else (0, missing)
        padded.append(torch.nn.functional.pad(f, pad) if missing else f)
    return torch.stack(padded)


class _Layout:
    """What layers with the same segments, ranks and bank rows share within one pass: the strategy chosen
    for them and, for the grouped one, its index tensors. Computed once per pass, not once per layer."""

    def __init__(self, entries: list[tuple[Segment, LoraWeights]], tokens: int, device: torch.device,
                 strategy: str, written: set[tuple[int, int]] | None = None,
                 gathered: dict[tuple[object, ...], object] | None = None) -> None:
        lengths = [s.end - s.start for s, _ in entries]
        ranks = [w.A.shape[0] for _, w in entries]
        self.rank = max(ranks)
        self.grouped = strategy == "grouped" or (strategy == "auto" and _worth_grouping(lengths, ranks))
        self.covers_all = sum(lengths) == tokens
        self.uniform = self.covers_all and len(set(lengths)) == 1
        slots = [w.slot for _, w in entries]
        consecutive = slots[0] >= 0 and slots == list(range(slots[0], slots[0] + len(slots)))
        self.first_slot = slots[0] if consecutive else None
        """The first bank row when the segments' adapters sit in consecutive rows (see `_bank_stacks`)."""
        self.slots: torch.Tensor | None = None
        """Bank rows of the segments' adapters, built on first use (see `_bank_stacks`)."""
        self.written = written if written is not None else set()
        """The pass's gradient rows already written (`PassPlan.written`, see worker/engine/grad_rows.py)."""
        self.gathered = gathered
        """Factors gathered from bank rows, shared with other model calls (`PassPlan.gathered`)."""
        self._device = device
        self._trigger: torch.Tensor | None = None
        dtype = entries[0][1].A.dtype
        self.scale = torch.tensor([w.scale for _, w in entries], dtype=dtype, device=device)[:, None, None]
        if self.grouped and not self.uniform:
            self._index(entries, lengths, tokens, device)

    def trigger(self) -> torch.Tensor:
        """A leaf that requires grad, handed to `GroupedLoraDelta` instead of the factors when all of them
        are banked (their gradients bypass autograd), so the node still joins the graph."""
        if self._trigger is None:
            self._trigger = torch.zeros((), device=self._device, requires_grad=True)
        return self._trigger

    def _index(self, entries: list[tuple[Segment, LoraWeights]], lengths: list[int], tokens: int,
               device: torch.device) -> None:
        offsets = torch.arange(max(lengths))
        starts = torch.tensor([s.start for s, _ in entries])[:, None]
        inside = offsets[None, :] < torch.tensor(lengths)[:, None]
        self.gather = torch.where(inside, starts + offsets[None, :], tokens).to(device)
        self.valid = inside.reshape(-1).nonzero().squeeze(1).to(device)
        self.positions = torch.cat([torch.arange(s.start, s.end) for s, _ in entries]).to(device)


def _worth_grouping(lengths: list[int], ranks: list[int]) -> bool:
    """`auto`'s cost model: group unless padding would waste more than `_MAX_PADDING_WASTE` of the FLOPs."""
    used = sum(n * r for n, r in zip(lengths, ranks, strict=True))
    return used >= (1 - _MAX_PADDING_WASTE) * len(lengths) * max(lengths) * max(ranks)


def _layout(plan: PassPlan, entries: list[tuple[Segment, LoraWeights]], tokens: int, device: torch.device,
            strategy: str) -> _Layout:
    # A segment is one adapter: its rank, scale and bank row are the same in every layer, so which segments
    # a layer serves is the whole key (the plan keeps its segments alive: their ids stay unique).
    key = tuple(id(s) for s, _ in entries)
    layout = plan.layouts.get(key)
    if layout is None:
        layout = _Layout(entries, tokens, device, strategy, plan.written, plan.gathered)
        plan.layouts[key] = layout
    return layout  # type: ignore[return-value]


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
