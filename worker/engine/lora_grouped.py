"""The grouped multi-LoRA product: every segment's delta as one pair of batched GEMMs.

The segments of a layer are padded to one length (and their factors to one rank, with zeros) and stacked,
so all adapters' products are two `bmm`s whatever the number of tenants, wasting only the padding. With many
small segments (the RL regime) per-op overhead dominates, which is what grouping removes. This module owns
the layout a pass shares between its layers (`Layout`: the strategy chosen and the index tensors), a layer's
route (`Route`), reading the factors from their banks (worker/engine/banks.py: a view for consecutive rows,
otherwise one gather), and `GroupedLoraDelta`, the one autograd node with a hand-written backward that
delivers the factors' gradients to their bank rows (worker/engine/grad_rows.py). The deltas are added into
the layer's base output by the second GEMM (`baddbmm_`) wherever the segments cover it end to end.
"""

from __future__ import annotations

import torch

from worker.engine.grad_rows import deliver_stacked
from worker.engine.passes import LoraWeights, PassPlan, Segment
from worker.engine.rank_gemm import NARROW_BELOW, rank_product

# `auto` groups when padding wastes at most this fraction of the LoRA FLOPs. Grouping always saves
# ops (2 GEMMs per segment become 2 batched GEMMs), so only heavy padding makes the loop worthwhile.
_MAX_PADDING_WASTE = 0.5

DECODE_COPY_LIMIT = 1 << 20
"""Most elements of B's stack a decode step's plan copies into its own layout (4 MiB in fp32, per layer): the
copy lives as long as the plan, so a CPU deployment of a large model with many tenants keeps reading B
through its view instead of doubling its adapters' memory for a sample batch."""


def plus(y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """`y` plus a delta computed apart, in `y`'s dtype: where no GEMM can add into `y` itself."""
    return y + delta.to(y.dtype)


class Route:
    """One layer's share of a pass plan (`PassPlan.routes`): the segments it serves with their factors, the
    grouped layout when one applies, and (inference only) those factors stacked."""

    def __init__(self, entries: list[tuple[Segment, LoraWeights]], layout: Layout | None) -> None:
        self.entries = entries
        self.weights = [w for _, w in entries]
        self.layout = layout
        self.stacks: tuple[torch.Tensor, torch.Tensor] | None = None
        """Without grad, the factors stacked for the two batched GEMMs (A as (S, R, in), B as (S, out, R)), kept
        for the plan's later calls: the decode steps of a sample batch (one plan while no row leaves) find them
        here instead of slicing the banks again in every layer and step."""
        self.decode: tuple[torch.Tensor, torch.Tensor] | None = None
        """Without grad and with few rows per segment (a decode step), the operands of the two batched GEMMs as
        the CPU's batched GEMM reads them fastest, made once per plan: A already scaled, (S, R, in), and B laid
        out contiguously as (S, R, out)."""


def add_grouped_deltas(x: torch.Tensor, y: torch.Tensor, route: Route, out_features: int) -> torch.Tensor:
    """`y` plus all segments' deltas, with two batched GEMMs over padded segments and zero-padded ranks."""
    layout, weights = route.layout, route.weights
    assert layout is not None
    dtype = weights[0].A.dtype
    # Equal segments covering every token: the second GEMM adds into `y` itself (viewed per segment).
    into = y if layout.uniform and y.dtype == dtype else None
    if layout.uniform:
        # (tokens, in) as it is, viewed per segment where it is used: no gather and no scatter.
        x_in = x.to(dtype)
    else:
        x_ext = torch.cat([x.to(dtype), x.new_zeros((1, x.shape[1]), dtype=dtype)])  # row T: padding source
        x_in = x_ext[layout.gather]
    if not torch.is_grad_enabled():
        out_S_L_out = _grouped_inference(_per_segment(x_in, len(weights)), into, route)
    else:
        out_S_L_out = _grouped_with_graph(x_in, into, layout, _bank_stacks(weights, layout), weights)
    if into is not None:
        return out_S_L_out  # `y`, deltas added
    if layout.uniform:
        return plus(y, out_S_L_out.reshape(-1, out_features))
    picked = out_S_L_out.reshape(-1, out_features)[layout.valid].to(y.dtype)
    if layout.covers_all:
        return y + picked
    if not torch.is_grad_enabled():
        return y.index_add_(0, layout.positions, picked)
    return y.index_add(0, layout.positions, picked)  # rows outside every segment keep the base output


def _grouped_inference(x_S_L_in: torch.Tensor, into: torch.Tensor | None, route: Route) -> torch.Tensor:
    """The grouped product without grad (sampling): no graph to build, so no autograd node either; its `apply`
    machinery was as costly as the two GEMMs themselves on a decode step of a few rows per adapter."""
    layout, weights = route.layout, route.weights
    assert layout is not None
    if route.stacks is None:
        route.stacks = _bank_stacks(weights, layout) or (
            _stack([w.A for w in weights], layout.rank, dim=0), _stack([w.B for w in weights], layout.rank, dim=1))
    if not _decode_step(x_S_L_in, route.stacks[1]):
        return _grouped_product(x_S_L_in, into, *route.stacks, layout.scale)[1]
    if route.decode is None:
        a_S_R_in, b_S_out_R = route.stacks
        route.decode = a_S_R_in * layout.scale, b_S_out_R.transpose(1, 2).contiguous()
    a_scaled, b_S_R_out = route.decode
    return _add_second_product(torch.bmm(x_S_L_in, a_scaled.transpose(1, 2)), into, b_S_R_out)


def _decode_step(x_S_L_in: torch.Tensor, b_S_out_R: torch.Tensor) -> bool:
    """Whether a grouped call without grad gets operands laid out once per plan (`Route.decode`): a decode step
    on CPU, a few rows per segment, whose plan's next steps reuse them. Read through its transposed view, B made
    `baddbmm_` 2-2.4x slower at these shapes (8 x 4 rows, out 768: 11.2 against 4.8 us); one copy per plan pays
    for itself within a step or two, and folding the scale into A saves a pass over h in every step."""
    return (x_S_L_in.shape[1] < NARROW_BELOW and x_S_L_in.device.type == "cpu"
            and b_S_out_R.numel() <= DECODE_COPY_LIMIT)


def _grouped_with_graph(x_in: torch.Tensor, into: torch.Tensor | None, layout: Layout,
                        stacks: tuple[torch.Tensor, torch.Tensor] | None, weights: list[LoraWeights]) -> torch.Tensor:
    """The grouped product as one autograd node (grad is on); `x_in` (S, L, in), or (tokens, in) for equal
    segments end to end (see `GroupedLoraDelta`)."""
    if stacks is not None and all(w.grad_rows is not None for w in weights):
        # Gradients go to bank rows: autograd only needs to know whether anything here trains.
        inputs = [layout.trigger()] if any(w.A.requires_grad for w in weights) else []
    else:
        inputs = [w.A for w in weights] + [w.B for w in weights]
    return GroupedLoraDelta.apply(x_in, into, layout, stacks, weights, *inputs)


def _grouped_product(x_S_L_in: torch.Tensor, into: torch.Tensor | None, a_S_R_in: torch.Tensor,
                     b_S_out_R: torch.Tensor, scale_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, out): h = scale_s * x_s @ A_s.T, out = h @ B_s.T for every segment s, as two batched GEMMs; with
    `into` ((S * L, out), segments end to end), out is `into` with h @ B_s.T added in place."""
    h_S_L_R = rank_product(x_S_L_in, a_S_R_in.transpose(1, 2)).mul_(scale_S)
    return h_S_L_R, _add_second_product(h_S_L_R, into, b_S_out_R.transpose(1, 2))


def _add_second_product(h_S_L_R: torch.Tensor, into: torch.Tensor | None, b_S_R_out: torch.Tensor) -> torch.Tensor:
    """h_s @ B_s.T for every segment; with `into` (segments end to end), added into it in place."""
    if into is None:
        return torch.bmm(h_S_L_R, b_S_R_out)
    into.view(h_S_L_R.shape[0], -1, into.shape[1]).baddbmm_(h_S_L_R, b_S_R_out)
    return into


class GroupedLoraDelta(torch.autograd.Function):
    """scale_s * (x_s @ A_s.T) @ B_s.T for every segment s, as one autograd node with a hand-written backward;
    given `into` (the layer's base output, segments end to end), `into` with the products added in place.

    The same four batched GEMMs autograd would run, without its bookkeeping around them: no stack/unbind
    nodes for the factors, no separate scaling node, and the factors' gradients written by the batched GEMM
    straight into the adapters' gradient rows when they are banked (worker/engine/grad_rows.py; others get
    theirs back through autograd). With many tenants and small segments those per-op costs were as large as
    the GEMMs themselves. Gradients are computed only for the inputs that need them (a forward-only
    tenant's factors are detached).

    The input is (S, L, in), or the layer's (tokens, in) itself when the segments are equal and cover it, viewed
    per segment inside. Then its gradient goes back as a tensor of its own (the batched GEMM writes it through a
    per-segment view), where a view of a (S, L, in) gradient would make autograd allocate the sum with the base
    GEMM's gradient of the same input instead of adding into it in place.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x_in: torch.Tensor, into: torch.Tensor | None,
                layout: Layout, stacks: tuple[torch.Tensor, torch.Tensor] | None, weights: list[LoraWeights],
                *factors: torch.Tensor) -> torch.Tensor:
        # `factors` are the autograd inputs: each adapter's leaves, or (all adapters banked, their
        # gradients going to bank rows) at most one trigger leaf that puts this node in the graph.
        # `stacks`, when given, hold the factors already stacked (rows of the adapters' bank).
        count = len(weights)
        ctx.trains = None if len(factors) == 2 * count else tuple(w.A.requires_grad for w in weights)
        ctx.x_shape = x_in.shape
        x_S_L_in = _per_segment(x_in, count)
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
        layout: Layout = ctx.layout
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
            grad_h = rank_product(grad_S_L_out, b_S_out_R).mul_(layout.scale)
            grad_x = None
            if ctx.needs_input_grad[0]:
                grad_x = grad_h.new_empty(ctx.x_shape)
                torch.bmm(grad_h, a_S_R_in, out=grad_x.view(x_S_L_in.shape))
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


def _per_segment(x: torch.Tensor, count: int) -> torch.Tensor:
    """(S, L, in) as it is; (tokens, in) of `count` equal segments end to end viewed as (S, L, in)."""
    return x if x.dim() == 3 else x.view(count, -1, x.shape[1])


def _bank_stacks(weights: list[LoraWeights], layout: Layout) -> tuple[torch.Tensor, torch.Tensor] | None:
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


class Layout:
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


def layout_for(plan: PassPlan, entries: list[tuple[Segment, LoraWeights]], tokens: int, device: torch.device,
            strategy: str) -> Layout:
    # A segment is one adapter: its rank, scale and bank row are the same in every layer, so which segments
    # a layer serves is the whole key (the plan keeps its segments alive: their ids stay unique).
    key = tuple(id(s) for s, _ in entries)
    layout = plan.layouts.get(key)
    if layout is None:
        layout = Layout(entries, tokens, device, strategy, plan.written, plan.gathered)
        plan.layouts[key] = layout
    return layout  # type: ignore[return-value]

