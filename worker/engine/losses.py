"""Tinker's built-in losses on per-token logprobs, exactly as the wire protocol defines them (§6.3).

Every loss is a *sum* over tokens (no normalisation by token count). Each function returns the
elementwise loss shaped like the targets; the caller sums it into `loss:sum` and into the backward.
Every function sees one datum at a time (sequence-level quantities such as GSPO's ratio never mix datums,
so a datum's loss is the same alone or packed beside other tenants'). `custom` losses are interpreted by
worker/engine/custom_loss.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2
DEFAULT_DRO_BETA = 0.05
DEFAULT_STABLE_REINFORCE_CAP = 2.0
"""Truncation of stable_reinforce's importance weight (`clip_high_threshold`)."""
DEFAULT_KL_COEFF = 0.0

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


def gspo(lp: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    """Token-level GSPO: s = exp(mean over `sequence_ratio_mask` of (lp - logprobs)) for the whole sequence;
    each token carries s's value with the gradient of its own logprob (s_t = sg(s) * exp(lp_t - sg(lp_t))),
    then PPO's clipped objective per token. Without a mask every token enters the ratio."""
    lo, hi = _clip_bounds(config)
    log_ratio = lp - inputs["logprobs"]
    mask = inputs.get("sequence_ratio_mask")
    mask = torch.ones_like(log_ratio) if mask is None else mask.to(log_ratio.dtype)
    seq_log_ratio = (log_ratio * mask).sum() / mask.sum().clamp_min(1.0)
    token_ratio = torch.exp(seq_log_ratio.detach() + lp - lp.detach())
    adv = inputs["advantages"]
    return -torch.minimum(token_ratio * adv, token_ratio.clamp(lo, hi) * adv)


def stable_reinforce(lp: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    """REINFORCE with a truncated importance weight against the sampler's recorded logprobs q:
    -sg(min(exp(lp - q), cap)) * A * lp + kl_coeff/2 * (lp - q)^2; `cap` = `clip_high_threshold` (2.0),
    `kl_coeff` (0.0). q comes from the samples' recorded stability info (the control plane fills `logprobs`
    from the datum's provenance), so the weight is computed against what the server actually sampled."""
    cap = float(config.get("clip_high_threshold", DEFAULT_STABLE_REINFORCE_CAP))
    kl = float(config.get("kl_coeff", DEFAULT_KL_COEFF))
    q = inputs["logprobs"]
    weight = torch.exp(lp - q).clamp(max=cap).detach()
    return -weight * inputs["advantages"] * lp + 0.5 * kl * (lp - q) ** 2


LOSSES: dict[str, Callable[[torch.Tensor, LossInputs, LossConfig], torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}
