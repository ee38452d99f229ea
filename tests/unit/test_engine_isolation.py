"""Acceptance 2: an adapter trained in packed passes beside others equals the same adapter trained alone.

20 steps of X packed with 3 other adapters (own data, own learning rates, other loss functions and
ranks) leave X within 1e-5 of 20 steps of X alone; an adapter that gets no requests does not change.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.domain.training import AdamParams, AdapterId, Datum, ForwardBackwardWork, LoraSpec
from worker.engine.engine import Engine, EngineConfig

STEPS = 20


def _ce_datum(rng: np.random.Generator, vocab: int, n: int) -> Datum:
    seq = rng.integers(0, vocab, n + 1)
    return Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(n, np.float32)})


def _rl_datum(rng: np.random.Generator, vocab: int, n: int) -> Datum:
    seq = rng.integers(0, vocab, n + 1)
    return Datum(seq[:-1], {"target_tokens": seq[1:], "logprobs": rng.normal(-6, 0.5, n).astype(np.float32),
                            "advantages": rng.normal(0, 1, n).astype(np.float32)})


def _snapshot(engine: Engine, aid: AdapterId) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in engine.adapter(aid).params.items()}


@pytest.mark.parametrize("strategy", ["loop", "grouped"])
def test_packed_training_equals_training_alone(tiny_model_dir, strategy: str) -> None:  # noqa: ANN001
    config = EngineConfig(device="cpu", dtype="float32", lora_strategy=strategy)
    packed, alone = Engine(tiny_model_dir, name="t", config=config), Engine(tiny_model_dir, name="t", config=config)
    vocab = packed.info.vocab_size
    rng = np.random.default_rng(0)
    x_spec = LoraSpec(rank=8, seed=42)
    x_data = [[_ce_datum(rng, vocab, int(rng.integers(4, 16))) for _ in range(2)] for _ in range(STEPS)]
    x_hp = AdamParams(learning_rate=5e-3, weight_decay=0.01, grad_clip_norm=1.0)

    others = {
        AdapterId("o1"): (LoraSpec(rank=4, seed=1), "cross_entropy", AdamParams(learning_rate=1e-2)),
        AdapterId("o2"): (LoraSpec(rank=16, seed=2, train_mlp=False), "ppo", AdamParams(learning_rate=3e-3)),
        AdapterId("o3"): (LoraSpec(rank=32, seed=3), "importance_sampling", AdamParams(learning_rate=1e-3,
                                                                                        beta2=0.99)),
    }
    idle = AdapterId("idle")
    for engine in (packed, alone):
        engine.create_adapter(AdapterId("x"), x_spec)
    for aid, (spec, _, _) in others.items():
        packed.create_adapter(aid, spec)
    packed.create_adapter(idle, LoraSpec(rank=8, seed=7))
    idle_before = _snapshot(packed, idle)

    for step in range(STEPS):
        works = [ForwardBackwardWork(AdapterId("x"), x_data[step])]
        for aid, (_, loss_fn, _) in others.items():
            make = _ce_datum if loss_fn == "cross_entropy" else _rl_datum
            works.append(ForwardBackwardWork(aid, [make(rng, vocab, int(rng.integers(4, 16)))], loss_fn))
        results = packed.forward_backward(works)
        assert all(hasattr(r, "outputs") for r in results), results
        for aid, (_, _, hp) in others.items():
            packed.optim_step(aid, hp)
        packed.optim_step(AdapterId("x"), x_hp)

        alone.forward_backward([ForwardBackwardWork(AdapterId("x"), x_data[step])])
        alone.optim_step(AdapterId("x"), x_hp)

    assert packed.stats.multi_adapter_passes >= STEPS
    x_packed, x_alone = _snapshot(packed, AdapterId("x")), _snapshot(alone, AdapterId("x"))
    for key, value in x_alone.items():
        assert float((x_packed[key] - value).abs().max()) <= 1e-5, key
    for key, value in idle_before.items():
        assert torch.equal(_snapshot(packed, idle)[key], value), f"idle adapter changed at {key}"
    b_norm = sum(float(v.norm()) for k, v in x_alone.items() if k.endswith("lora_B"))
    assert b_norm > 0, "X must actually have trained"
