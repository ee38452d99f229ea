"""Per-adapter AdamW: the hyper-parameters of each `optim_step` call, state kept per adapter.

Decoupled weight decay as in AdamW; optional global-norm clipping over this adapter's gradients only.
The state is plain tensors (not a `torch.optim.AdamW`) so we can snapshot, spill and restore it
bit-for-bit. The update itself is torch's fused AdamW kernel (one pass over memory for all of the
adapter's tensors): with many tenants, optimizer steps are memory-bound and their count grows with the
number of adapters, so a single fused pass matters. A `_foreach_*` fallback covers builds without it.
"""

from __future__ import annotations

import math

import torch

from services.domain.training import AdamParams
from worker.engine.adapters import AdapterState


def adamw_step(adapter: AdapterState, hp: AdamParams) -> dict[str, float]:
    """Apply one AdamW step with `hp` to every parameter that has a gradient; then zero gradients.

    The global gradient norm is computed only when clipping needs it: it is a full extra read of the
    gradients, a cost every tenant would pay on every step for a metric.
    """
    # `.grad` read once per parameter: with many tenants this bookkeeping is a visible part of the step.
    with_grads = [(k, p, g) for k, p in sorted(adapter.params.items()) if (g := p.grad) is not None]
    metrics = {"learning_rate:mean": hp.learning_rate}
    if not with_grads:
        adapter.zero_grad()
        return metrics
    names, params, grads = (list(column) for column in zip(*with_grads, strict=True))
    state = adapter.optimizer
    state.step += 1
    m, v = _moments(state.exp_avg, names, params), _moments(state.exp_avg_sq, names, params)
    with torch.no_grad():
        if hp.grad_clip_norm > 0:
            grad_norm = _global_grad_norm(grads)
            metrics["grad_norm:mean"] = grad_norm
            clip = _clip_coefficient(grad_norm, hp.grad_clip_norm)
            if clip != 1.0:
                grads = torch._foreach_mul(grads, clip)
        if _HAS_FUSED:
            _fused_update(params, grads, m, v, hp, state.step)
        else:
            _update(params, grads, m, v, hp, state.step)
    adapter.zero_grad()
    return metrics


def _moments(store: dict[str, torch.Tensor], names: list[str], params: list[torch.Tensor]) -> list[torch.Tensor]:
    for name, p in zip(names, params, strict=True):
        if name not in store:
            store[name] = torch.zeros_like(p)
    return [store[n] for n in names]


_HAS_FUSED = hasattr(torch, "_fused_adamw_")


def _fused_update(params: list[torch.Tensor], grads: list[torch.Tensor], m: list[torch.Tensor],
                  v: list[torch.Tensor], hp: AdamParams, step: int) -> None:
    # The kernel reads the (already incremented) step for bias correction; one shared scalar suffices.
    steps = [torch.tensor(float(step), device=params[0].device)] * len(params)
    torch._fused_adamw_(params, grads, m, v, [], steps, lr=hp.learning_rate, beta1=hp.beta1, beta2=hp.beta2,
                        weight_decay=hp.weight_decay, eps=hp.eps, amsgrad=False, maximize=False)


def _update(params: list[torch.Tensor], grads: list[torch.Tensor], m: list[torch.Tensor],
            v: list[torch.Tensor], hp: AdamParams, step: int) -> None:
    bias1 = 1 - hp.beta1**step
    bias2 = 1 - hp.beta2**step
    torch._foreach_mul_(m, hp.beta1)
    torch._foreach_add_(m, grads, alpha=1 - hp.beta1)
    torch._foreach_mul_(v, hp.beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - hp.beta2)
    if hp.weight_decay:
        torch._foreach_mul_(params, 1 - hp.learning_rate * hp.weight_decay)
    denom = torch._foreach_div(v, bias2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, hp.eps)
    torch._foreach_addcdiv_(params, m, denom, value=-hp.learning_rate / bias1)


def _global_grad_norm(grads: list[torch.Tensor]) -> float:
    norms = torch._foreach_norm(grads)
    return float(torch.stack(norms).float().norm())


def _clip_coefficient(grad_norm: float, max_norm: float) -> float:
    if max_norm <= 0 or not math.isfinite(grad_norm) or grad_norm <= max_norm:
        return 1.0
    return max_norm / (grad_norm + 1e-6)
