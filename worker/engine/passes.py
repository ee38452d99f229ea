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
    """One layer's factors of every adapter in a bank (worker/engine/banks.py), stacked row by row."""

    A: torch.Tensor
    """(rows, rank, in_features)"""
    B: torch.Tensor
    """(rows, out_features, rank)"""


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
    reads the stack instead of copying the factors together."""
    slot: int = -1


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
