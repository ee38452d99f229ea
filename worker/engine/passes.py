"""The pass context: which token ranges belong to which adapter, and where sequences start.

Every multi-LoRA layer and the attention function read the *current* pass plan from one `PassContext`
owned by the engine. A plan is set for exactly one model call (`with ctx.plan(...)`), so layers never
carry per-request state between calls.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class LayerBank:
    """One layer's factors of every adapter in a bank (worker/engine/banks.py), stacked row by row, and the
    rows their gradients accumulate in."""

    A: torch.Tensor
    """(rows, rank, in_features)"""
    B: torch.Tensor
    """(rows, out_features, rank)"""
    grad_A: torch.Tensor
    """Gradients of `A`, row by row (meaningful only for adapters whose `GradRows.valid` is set)."""
    grad_B: torch.Tensor
    exp_avg_A: torch.Tensor
    """AdamW first moments of `A`, row by row (the adapters' `OptimizerState` entries are views of them)."""
    exp_avg_B: torch.Tensor
    exp_avg_sq_A: torch.Tensor
    exp_avg_sq_B: torch.Tensor

    def rows(self, kind: str, factor: str) -> torch.Tensor:
        """The stack of `kind` ("" for the factors, "grad", "exp_avg", "exp_avg_sq") of factor "A" or "B"."""
        return getattr(self, f"{kind}_{factor}" if kind else factor)


@dataclass
class GradRows:
    """Whether a banked adapter's gradient rows hold its accumulated gradient. When not, they hold stale
    values and the adapter's next pass overwrites them instead of adding to them: an optimizer step then
    needs no zeroing pass over the gradients."""

    valid: bool = False


@dataclass(frozen=True)
class LoraWeights:
    """One adapter's LoRA factors for one linear layer: delta = scale * (x @ A.T) @ B.T."""

    A: torch.Tensor
    """(rank, in_features)"""
    B: torch.Tensor
    """(out_features, rank)"""
    scale: float
    bank: LayerBank | None = None
    """The stack `A` and `B` are row `slot` of, when the adapter is resident in a bank; a grouped pass
    reads the stack instead of copying the factors together, and writes the factors' gradients into the
    bank's gradient rows (autograd accumulates them into `.grad` only for factors outside any bank)."""
    slot: int = -1
    grad_rows: GradRows | None = None
    """The adapter's gradient-row state (set with `bank`)."""


@dataclass(frozen=True)
class Segment:
    """A contiguous range of flattened tokens [start, end) served by one adapter (None = base model)."""

    start: int
    end: int
    weights: Mapping[str, LoraWeights] | None
    """Layer name → factors; None or a missing layer means the base weights alone."""


@dataclass
class PassPlan:
    segments: list[Segment]
    seq_lens: list[int] | None = None
    """Packed training layout: lengths of the sequences laid end to end in one row (None = padded batch)."""
    layouts: dict[tuple[object, ...], object] = field(default_factory=dict)
    """Per-pass cache of the grouped LoRA strategy's index tensors (layers with equal layouts share)."""
    written: set[tuple[int, int]] = field(default_factory=set)
    """Gradient rows (id of the row stack, row) this pass has written: a second write adds to the first."""
    gathered: dict[tuple[object, ...], object] | None = None
    """Factors gathered from bank rows, reusable by every model call that shares this dict: only calls
    between which no weight can change (the decode steps of one sample batch) may share one. None: each
    call gathers its own."""
    routes: dict[str, object] = field(default_factory=dict)
    """Per layer, what its `MultiLoraLinear` works out from the segments (the segments' factors, the layout
    and, without grad, the factors stacked): worked out on the layer's first call with this plan. A plan is
    made for one model call, except that the decode steps of a sample batch share one while no row leaves
    the batch (worker/engine/sampler.py): neither the segments nor any weight change between them."""


@dataclass
class PassContext:
    """Holds the plan of the model call in flight; layers look it up instead of owning per-call state."""

    current: PassPlan | None = field(default=None)
    lora_strategy: str = "auto"
    """`loop` (one low-rank product per segment), `grouped` (padded segments, batched GEMMs) or `auto`
    (picks per layer and pass; see worker/engine/lora.py)."""

    @contextmanager
    def plan(self, plan: PassPlan) -> Iterator[PassPlan]:
        if self.current is not None:
            raise RuntimeError("a pass is already in flight on this model; passes must not nest")
        self.current = plan
        try:
            yield plan
        finally:
            self.current = None


def segments_for_rows(row_weights: list[Mapping[str, LoraWeights] | None], row_len: int) -> list[Segment]:
    """Segments for a padded (rows, row_len) batch: consecutive rows of one adapter share a segment."""
    segments: list[Segment] = []
    for i, weights in enumerate(row_weights):
        start, end = i * row_len, (i + 1) * row_len
        if segments and segments[-1].weights is weights:
            last = segments.pop()
            start = last.start
        segments.append(Segment(start, end, weights))
    return segments
