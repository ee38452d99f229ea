"""Our AdamW against torch's own: `torch.optim.AdamW` (its plain single-tensor loop, `foreach=False`) after
`torch.nn.utils.clip_grad_norm_`, over several steps whose hyper-parameters change from step to step.

worker/engine/optim.py keeps its state in plain tensors and calls torch's fused kernel (or a `_foreach_*`
fallback) itself, split into `prepare_step` (clipping, the `grad_norm` metric) and a deferred update that
may run several banked adapters together (`apply_rows`). Until now it was only compared with itself; here
every path is held to the reference: an adapter with private tensors through the fused kernel and through
the fallback, and banked adapters in the engine whose deferred steps are applied together.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from services.domain.training import AdamParams, AdapterId, Datum, ForwardBackwardWork, LoraSpec
from worker.engine import optim
from worker.engine.adapters import AdapterState
from worker.engine.engine import Engine, EngineConfig

# Each step changes every hyper-parameter; clipping is off, binding (norm above the limit) or loose.
STEPS = [
    AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0),
    AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.5),
    AdamParams(learning_rate=5e-2, beta1=0.95, beta2=0.9, eps=1e-6, weight_decay=0.01, grad_clip_norm=1e3),
    AdamParams(learning_rate=1e-3, beta1=0.0, beta2=0.999, eps=1e-3, weight_decay=0.5, grad_clip_norm=0.05),
    AdamParams(learning_rate=2e-2, beta1=0.5, beta2=0.5, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0),
]
SHAPES = {"l0.lora_A": (4, 16), "l0.lora_B": (32, 4), "l1.lora_A": (4, 32), "l1.lora_B": (16, 4)}


class Reference:
    """torch's AdamW and gradient clipping over copies of an adapter's factors."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.names = sorted(params)
        self.params = [nn.Parameter(params[n].detach().clone()) for n in self.names]
        self.opt = torch.optim.AdamW(self.params, foreach=False, fused=False)

    def step(self, grads: dict[str, torch.Tensor], hp: AdamParams) -> float | None:
        """One step from `grads` (before clipping); the global norm when `hp` clips, as we report it."""
        for p, name in zip(self.params, self.names, strict=True):
            p.grad = grads[name].detach().clone()
        norm = None
        if hp.grad_clip_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, hp.grad_clip_norm, foreach=False))
        group = self.opt.param_groups[0]
        group.update(lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
        self.opt.step()
        return norm

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in zip(self.names, self.params, strict=True)}


def _grads(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Scales differ per tensor so clipping and the second moment see uneven gradients.
    return {n: torch.randn(s, generator=gen) * (0.1 + i) for i, (n, s) in enumerate(sorted(shapes.items()))}


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], step: int) -> None:
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"step {step} "
                                   f"{n}: {m}")


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernel", "foreach-fallback"])
def test_private_adapter_steps_match_torch_adamw(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if fused and not optim._HAS_FUSED:
        pytest.fail("this torch has no _fused_adamw_: the fused path cannot be checked")
    monkeypatch.setattr(optim, "_HAS_FUSED", fused)
    gen = torch.Generator().manual_seed(0)
    params = {n: nn.Parameter(torch.randn(s, generator=gen)) for n, s in SHAPES.items()}
    adapter = AdapterState(adapter_id=AdapterId("a"), spec=LoraSpec(rank=4), seed=0, params=params)
    reference = Reference(params)
    for step, hp in enumerate(STEPS, start=1):
        grads = _grads(step, SHAPES)
        for name, p in adapter.params.items():
            p.grad = grads[name].clone()
        metrics, ready = optim.prepare_step(adapter, hp)
        assert ready
        optim.apply_step(adapter, hp)
        norm = reference.step(grads, hp)
        assert metrics["learning_rate:mean"] == hp.learning_rate
        if norm is None:
            assert "grad_norm:mean" not in metrics
        else:
            assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-6)
        assert adapter.optimizer.step == step and adapter.grads() == {}
        _assert_close({n: p.detach() for n, p in adapter.params.items()}, reference.state(), step)


def test_a_step_without_a_gradient_changes_nothing() -> None:
    params = {n: nn.Parameter(torch.ones(s)) for n, s in SHAPES.items()}
    adapter = AdapterState(adapter_id=AdapterId("a"), spec=LoraSpec(rank=4), seed=0, params=params)
    metrics, ready = optim.prepare_step(adapter, STEPS[1])
    assert not ready and metrics == {"learning_rate:mean": STEPS[1].learning_rate}
    assert adapter.optimizer.step == 0 and all(torch.equal(p, torch.ones_like(p)) for p in params.values())


def _work(aid: AdapterId, seed: int) -> ForwardBackwardWork:
    seq = np.random.default_rng(seed).integers(0, 512, 11)
    return ForwardBackwardWork(aid, [Datum(seq[:-1], {"target_tokens": seq[1:]})])


def test_banked_adapters_stepping_together_match_torch_adamw(tiny_model_dir: Path) -> None:
    """Three adapters in one bank, their deferred steps applied together over consecutive rows; one of them
    clips with a different limit (it still shares the update call). Each must match its own reference."""
    ids = [AdapterId(f"t{i}") for i in range(3)]
    engine = Engine(tiny_model_dir, name="t", config=EngineConfig(device="cpu", dtype="float32"))
    for i, aid in enumerate(ids):
        engine.create_adapter(aid, LoraSpec(rank=4, seed=i))
    references = {aid: Reference(dict(engine.adapter(aid).params)) for aid in ids}
    for step, base_hp in enumerate(STEPS, start=1):
        engine.forward_backward([_work(aid, 10 * step + i) for i, aid in enumerate(ids)])
        grads = {aid: {n: g.clone() for n, g in engine.adapter(aid).grads().items()} for aid in ids}
        for i, aid in enumerate(ids):
            hp = replace(base_hp, grad_clip_norm=0.01) if i == 1 else base_hp
            metrics = engine.optim_step(aid, hp).metrics
            norm = references[aid].step(grads[aid], hp)
            if norm is not None:
                assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
        assert len(engine.steps) == len(ids)  # all still pending: they are applied together below
        engine.apply_pending_steps()
        for aid in ids:
            state = engine.adapter(aid)
            assert state.optimizer.step == step
            _assert_close({n: p.detach() for n, p in state.params.items()}, references[aid].state(), step)
