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
        y = self.base(x)
        plan = self._ctx.current
        if plan is None:
            return y
        entries = [(seg, w) for seg in plan.segments if (w := _weights(seg, self.layer_name)) is not None]
        if not entries:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        if self._use_grouped(entries):
            delta = _grouped(x2, entries, plan, self.out_features)
        else:
            delta = self._looped(x2, entries, plan.segments)
        return y + delta.to(y.dtype).reshape(y.shape)

    def _use_grouped(self, entries: list[tuple[Segment, LoraWeights]]) -> bool:
        strategy = self._ctx.lora_strategy
        if strategy != "auto" or len(entries) == 1:
            return strategy == "grouped"
        longest = max(s.end - s.start for s, _ in entries)
        top_rank = max(w.A.shape[0] for _, w in entries)
        used = sum((s.end - s.start) * w.A.shape[0] for s, w in entries)
        return used >= (1 - _MAX_PADDING_WASTE) * len(entries) * longest * top_rank

    def _looped(self, x: torch.Tensor, entries: list[tuple[Segment, LoraWeights]],
                segments: list[Segment]) -> torch.Tensor:
        if len(entries) == 1 and len(segments) == 1:
            _, w = entries[0]
            return _delta(x, w)
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
            pieces.append(_delta(xs, w))
        return torch.cat(pieces, dim=0)


def _delta(x: torch.Tensor, w: LoraWeights) -> torch.Tensor:
    # Scale the (tokens, rank) product, not the (tokens, out) one: lm_head's out is the vocabulary.
    return ((x.to(w.A.dtype) @ w.A.t()) * w.scale) @ w.B.t()


def _grouped(x: torch.Tensor, entries: list[tuple[Segment, LoraWeights]], plan: PassPlan,
             out_features: int) -> torch.Tensor:
    """All segments' deltas with two batched GEMMs over padded segments and zero-padded ranks."""
    layout = _layout(plan, entries, x.shape[0], x.device)
    dtype = entries[0][1].A.dtype
    if layout.uniform:
        # Equal segments covering every token: a view, no gather and no scatter.
        x_S_L_in = x.to(dtype).view(len(entries), -1, x.shape[1])
    else:
        x_ext = torch.cat([x.to(dtype), x.new_zeros((1, x.shape[1]), dtype=dtype)])  # row T: padding source
        x_S_L_in = x_ext[layout.gather]
    factors = [w.A for _, w in entries] + [w.B for _, w in entries]
    stacks = _bank_stacks([w for _, w in entries], layout)
    out_S_L_out = GroupedLoraDelta.apply(x_S_L_in, layout.scale, layout.rank, stacks, *factors)
    if layout.uniform:
        return out_S_L_out.reshape(-1, out_features)
    picked = out_S_L_out.reshape(-1, out_features)[layout.valid]
    if layout.covers_all:
        return picked
    return x.new_zeros((x.shape[0], out_features), dtype=dtype).index_copy(0, layout.positions, picked)


class GroupedLoraDelta(torch.autograd.Function):
    """scale_s * (x_s @ A_s.T) @ B_s.T for every segment s, as one autograd node with a hand-written backward.

    The same four batched GEMMs autograd would run, without its bookkeeping around them: no stack/unbind
    nodes for the factors, no separate scaling node, and each factor's gradient handed back as a view of one
    stacked gradient (which `AccumulateGrad` adopts without a copy). With many tenants and small segments
    those per-op costs were as large as the GEMMs themselves. Gradients are computed only for the inputs
    that need them (a forward-only tenant's factors are detached).
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x_S_L_in: torch.Tensor, scale_S_1_1: torch.Tensor,
                rank: int, stacks: tuple[torch.Tensor, torch.Tensor] | None, *factors: torch.Tensor) -> torch.Tensor:
        # `factors` are the autograd inputs (each adapter's leaves); `stacks`, when given, hold the same
        # values already stacked (rows of the adapters' bank), so nothing needs copying together here.
        count = len(factors) // 2
        if stacks is None:
            stacks = (_stack(list(factors[:count]), rank, dim=0), _stack(list(factors[count:]), rank, dim=1))
        a_S_R_in, b_S_out_R = stacks
        h_S_L_R = torch.bmm(x_S_L_in, a_S_R_in.transpose(1, 2)).mul_(scale_S_1_1)
        ctx.save_for_backward(x_S_L_in, h_S_L_R, a_S_R_in, b_S_out_R, scale_S_1_1)
        ctx.ranks = [f.shape[0] for f in factors[:count]]
        return torch.bmm(h_S_L_R, b_S_out_R.transpose(1, 2))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad_S_L_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_S_L_in, h_S_L_R, a_S_R_in, b_S_out_R, scale_S_1_1 = ctx.saved_tensors
        ranks: list[int] = ctx.ranks
        needs = ctx.needs_input_grad
        count = len(ranks)
        grad_S_L_out = grad_S_L_out.contiguous()
        grad_x: torch.Tensor | None = None
        grads_a: list[torch.Tensor | None] = [None] * count
        grads_b: list[torch.Tensor | None] = [None] * count
        needs_a = any(needs[_FACTORS : _FACTORS + count])
        if needs[0] or needs_a:  # both go through the gradient of the low-rank activations
            grad_h = torch.bmm(grad_S_L_out, b_S_out_R).mul_(scale_S_1_1)
            grad_x = torch.bmm(grad_h, a_S_R_in) if needs[0] else None
            if needs_a:
                grad_a = torch.bmm(grad_h.transpose(1, 2), x_S_L_in)
                grads_a = _per_adapter(grad_a, ranks, needs[_FACTORS : _FACTORS + count], rank_dim=1)
        if any(needs[_FACTORS + count :]):
            grad_b = torch.bmm(grad_S_L_out.transpose(1, 2), h_S_L_R)
            grads_b = _per_adapter(grad_b, ranks, needs[_FACTORS + count :], rank_dim=2)
        return (grad_x, None, None, None, *grads_a, *grads_b)


def _per_adapter(stacked: torch.Tensor, ranks: list[int], needs: tuple[bool, ...],
                 rank_dim: int) -> list[torch.Tensor | None]:
    """Each adapter's gradient as a view of the stacked one, its rank padding cut off (None if not needed)."""
    if all(r == stacked.shape[rank_dim] for r in ranks):
        views = stacked.unbind(0)  # one call for all views: with many tenants, per-view indexing adds up
        return [v if need else None for v, need in zip(views, needs, strict=True)]
    return [stacked[i].narrow(rank_dim - 1, 0, r) if need else None
            for i, (r, need) in enumerate(zip(ranks, needs, strict=True))]


_FACTORS = 4
"""Position of the first factor among `GroupedLoraDelta.apply`'s inputs (x, scale, rank, stacks, *factors)."""


def _bank_stacks(weights: list[LoraWeights], layout: _Layout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The segments' factors straight from their shared bank: a view when their rows are consecutive,
    otherwise one gather. None when they are not all in one bank (the caller stacks them)."""
    bank = weights[0].bank
    if bank is None or any(w.bank is not bank for w in weights):
        return None
    first = weights[0].slot
    if all(w.slot == first + i for i, w in enumerate(weights)):
        return bank.A[first : first + len(weights)], bank.B[first : first + len(weights)]
    if layout.slots is None:
        layout.slots = torch.tensor([w.slot for w in weights], device=bank.A.device)
    return bank.A.index_select(0, layout.slots), bank.B.index_select(0, layout.slots)


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
    """Index tensors of one grouped layout; layers with the same segments and ranks share it."""

    def __init__(self, entries: list[tuple[Segment, LoraWeights]], tokens: int, device: torch.device) -> None:
        lengths = [s.end - s.start for s, _ in entries]
        longest = max(lengths)
        self.rank = max(w.A.shape[0] for _, w in entries)
        offsets = torch.arange(longest)
        starts = torch.tensor([s.start for s, _ in entries])[:, None]
        lens = torch.tensor(lengths)[:, None]
        inside = offsets[None, :] < lens
        self.gather = torch.where(inside, starts + offsets[None, :], tokens).to(device)
        self.valid = inside.reshape(-1).nonzero().squeeze(1).to(device)
        self.positions = torch.cat([torch.arange(s.start, s.end) for s, _ in entries]).to(device)
        self.covers_all = sum(lengths) == tokens
        self.uniform = self.covers_all and len(set(lengths)) == 1
        dtype = entries[0][1].A.dtype
        self.scale = torch.tensor([w.scale for _, w in entries], dtype=dtype, device=device)[:, None, None]
        self.slots: torch.Tensor | None = None
        """Bank rows of the segments' adapters, built on first use (see `_bank_stacks`)."""


def _layout(plan: PassPlan, entries: list[tuple[Segment, LoraWeights]], tokens: int,
            device: torch.device) -> _Layout:
    key = tuple((s.start, s.end, w.A.shape[0], w.scale, w.slot) for s, w in entries)
    layout = plan.layouts.get(key)
    if layout is None:
        layout = _Layout(entries, tokens, device)
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
