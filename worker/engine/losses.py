"""Tinker's built-in losses on per-token logprobs, exactly as the wire protocol defines them (§6.3).

Every loss is a *sum* over tokens (no normalisation by token count). Each function returns the
elementwise loss shaped like the targets; the caller sums it into `loss:sum` and into the backward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2
DEFAULT_DRO_BETA = 0.05

LossInputs = Mapping[str, torch.Tensor]
LossConfig = Mapping[str, float]


def cross_entropy(lp: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    # Weights are arbitrary reals (negative included): forward_backward_custom relies on it.
    return -inputs["weights"] * lp


def _ratio(lp: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    return torch.exp(lp - inputs["logprobs"])


def importance_sampling(lp: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    return -_ratio(lp, inputs) * inputs["advantages"]


def _clip_bounds(config: LossConfig) -> tuple[float, float]:
    return (float(config.get("clip_low_threshold", DEFAULT_CLIP_LOW)),
            float(config.get("clip_high_threshold", DEFAULT_CLIP_HIGH)))


def ppo(lp: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    lo, hi = _clip_bounds(config)
    ratio, adv = _ratio(lp, inputs), inputs["advantages"]
    return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)


def cispo(lp: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    lo, hi = _clip_bounds(config)
    clipped = _ratio(lp, inputs).clamp(lo, hi).detach()
    return -clipped * lp * inputs["advantages"]


def dro(lp: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    beta = float(config.get("beta", DEFAULT_DRO_BETA))
    return -(lp * inputs["advantages"] - 0.5 * beta * (lp - inputs["logprobs"]) ** 2)


LOSSES: dict[str, Callable[[torch.Tensor, LossInputs, LossConfig], torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}
