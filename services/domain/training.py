"""Training-side domain types: adapter specs, optimizer parameters, data and per-pass work items.

These are what the scheduler hands a `Backend`; wire types are converted into them at the gateway edge.
Arrays are numpy so that this core stays free of tensor frameworks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NewType

import numpy as np

from services.domain.custom_loss import CustomLossProgram

AdapterId = NewType("AdapterId", str)

LossFnName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce",
                     "custom"]
LOSS_FNS: tuple[LossFnName, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo",
                                    "stable_reinforce", "custom")

# Inputs each loss needs besides `target_tokens` (always required).
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages"),
    # `logprobs` is filled by the control plane from the samples the datum's provenance names when they were
    # recorded with `record_stability_info` (services/control/stability.py); a datum may also send it.
    "stable_reinforce": ("logprobs", "advantages"),
    "custom": (),  # the loss's own declared inputs (services/domain/custom_loss.py)
}

# Inputs a loss reads when present (shaped like `target_tokens`, float32).
OPTIONAL_LOSS_INPUTS: dict[str, tuple[str, ...]] = {"gspo": ("sequence_ratio_mask",)}

DEFAULT_LORA_ALPHA = 32.0


@dataclass(frozen=True)
class LoraSpec:
    """What a tenant asked for in `lora_config`, plus the scaling we apply (alpha / rank)."""

    rank: int = 32
    seed: int | None = None
    train_attn: bool = True
    """q/k/v/o projections."""
    train_mlp: bool = True
    """gate/up/down projections."""
    train_unembed: bool = True
    """the lm_head."""
    alpha: float = DEFAULT_LORA_ALPHA

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora_config.rank must be >= 1, got {self.rank}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class AdamParams:
    """One `optim_step` call's AdamW hyper-parameters (Tinker defaults)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    """Global L2 norm over this adapter's gradients; 0 disables clipping."""


@dataclass(frozen=True)
class SampledSpan:
    """`length` loss rows, in order, that reproduce tokens `[offset, offset + length)` of a sampled sequence
    (`sequence_id`); `sequence_id` is None for a run that came from a prompt (no sampler logprobs)."""

    sequence_id: str | None
    offset: int
    length: int


@dataclass
class Datum:
    """One sequence: input tokens and loss inputs aligned with them (position i predicts target i)."""

    tokens: np.ndarray
    """int64 (T,) input token ids."""
    loss_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    """`target_tokens` int64 (T,) or (T, K); `weights`/`logprobs`/`advantages` float32 of the same shape."""
    loss_spans: tuple[SampledSpan, ...] = ()
    """Provenance of the loss rows (`loss_fn_input_spans`), kept for `stable_reinforce` only."""

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def billed_tokens(self) -> int:
        """T x K: a `(T, K)` target costs K gathers and loss terms per position (K >= 1 counted)."""
        target = self.loss_inputs.get("target_tokens")
        k = int(target.shape[1]) if target is not None and target.ndim == 2 else 1
        return self.length * max(1, k)


@dataclass
class ForwardBackwardWork:
    """One request's share of a packed pass: an adapter (None = base model), its data and loss."""

    adapter_id: AdapterId | None
    data: list[Datum]
    loss_fn: LossFnName = "cross_entropy"
    loss_config: dict[str, float] = field(default_factory=dict)
    forward_only: bool = False
    custom_loss_id: str | None = None
    """`loss_fn == "custom"`: the stored loss's id (`loss_fn_config.loss_id`)."""
    custom_loss: CustomLossProgram | None = None
    """The stored loss, attached by the control plane (plain data; the worker interprets it)."""

    @property
    def num_tokens(self) -> int:
        return sum(d.length for d in self.data)

    @property
    def billed_tokens(self) -> int:
        """What metering and `tokens_per_minute` charge: T x K summed over the datums."""
        return sum(d.billed_tokens for d in self.data)


@dataclass
class DatumOutput:
    """Per-datum outputs: `logprobs` of the targets and `elementwise_loss`, both shaped like the targets."""

    logprobs: np.ndarray
    elementwise_loss: np.ndarray


@dataclass
class ForwardBackwardResult:
    outputs: list[DatumOutput]
    metrics: dict[str, float]
    """Keys are `name:reduction` (e.g. `loss:sum`)."""


@dataclass
class OptimStepResult:
    metrics: dict[str, float]


@dataclass
class WorkError:
    """A per-request failure returned as a result; the pass and other tenants carry on."""

    message: str
    category: Literal["user", "server"] = "user"
