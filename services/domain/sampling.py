"""Sampling domain types: parameters, work items and results (tokens, logprobs, stop reasons)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from services.domain.training import AdapterId

StopReason = Literal["length", "stop"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = -1
    """-1 disables top-k."""
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] | tuple[int, ...] | None = None
    """Stop strings or token ids; None keeps EOS stopping, () disables every stop including EOS."""


@dataclass
class SampleWork:
    """A sampling request: one prompt, `num_samples` continuations, from an adapter or the base (None)."""

    adapter_id: AdapterId | None
    prompt: np.ndarray
    """int64 (T,) prompt token ids."""
    num_samples: int = 1
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    record_stability_info: bool = False
    """Keep the sampled logprobs for `stable_reinforce` (services/control/stability.py)."""


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    """Entry 0 is None (nothing predicts the first token)."""
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
