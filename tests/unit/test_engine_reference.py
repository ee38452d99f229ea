"""Acceptance 1: one packed pass over adapters of ranks 4/8/16/32 equals transformers + peft alone.

Tolerances (fp32, CPU): per token |logprob - ref| <= 1e-5 and |loss - ref| <= 1e-5; the summed
`loss:sum` within 2e-6 relative (fp32 summation); for every LoRA factor ||grad - ref|| <= 1e-4 * ||ref||.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.domain.training import AdapterId, Datum, ForwardBackwardResult, ForwardBackwardWork, LoraSpec
from tests.reference.peft_reference import lora_grads, peft_model, reference_logprobs, reference_loss
from worker.engine.engine import Engine, EngineConfig

LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
SPECS = [
    LoraSpec(rank=4, seed=11),
    LoraSpec(rank=8, seed=12, train_unembed=False),
    LoraSpec(rank=16, seed=13, train_mlp=False, train_unembed=False),
    LoraSpec(rank=32, seed=14),
]
LOSS_CONFIG = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1, "beta": 0.3}


@pytest.fixture(scope="module", params=["loop", "grouped"])
def engine(tiny_model_dir, request: pytest.FixtureRequest) -> Engine:  # noqa: ANN001
    """Both LoRA strategies must match the reference (`auto` only chooses between them)."""
    config = EngineConfig(device="cpu", dtype="float32", lora_strategy=request.param)
    return Engine(tiny_model_dir, name="tiny", config=config)


def _give_b_values(engine: Engine, aid: AdapterId, seed: int) -> None:
    """Fresh adapters have B = 0 (they equal the base); random B makes every gradient non-trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in engine.adapter(aid).params.items():
            if key.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _factors(engine: Engine, aid: AdapterId) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in engine.adapter(aid).params.items()}


def _reference_model(tiny_model_dir, spec: LoraSpec, factors):  # noqa: ANN001, ANN202
    return peft_model(tiny_model_dir, spec.rank, spec.alpha, factors, spec.train_attn, spec.train_mlp,
                      spec.train_unembed)


def _data(rng: np.random.Generator, model, loss_fn: str, vocab: int, lengths: list[int]) -> list[Datum]:  # noqa: ANN001
    data = []
    for n in lengths:
        seq = rng.integers(0, vocab, n + 1)
        tokens, targets = seq[:-1], seq[1:]
        if loss_fn == "cross_entropy":
            inputs = {"weights": rng.normal(0.5, 1.0, n).astype(np.float32)}  # negative weights included
        else:
            with torch.no_grad():
                q = reference_logprobs(model, tokens, targets).numpy()
            inputs = {"logprobs": (q + rng.normal(0, 0.2, n)).astype(np.float32),
                      "advantages": rng.normal(0, 1, n).astype(np.float32)}
        data.append(Datum(tokens.astype(np.int64), {"target_tokens": targets.astype(np.int64), **inputs}))
    return data


CASES = [(loss_fn, "ragged") for loss_fn in LOSSES] + [("cross_entropy", "uniform"), ("ppo", "uniform")]


@pytest.mark.parametrize(("loss_fn", "lengths"), CASES)
def test_packed_pass_equals_peft_alone(engine: Engine, tiny_model_dir, loss_fn: str, lengths: str) -> None:  # noqa: ANN001
    """`ragged`: every datum its own length; `uniform`: equal lengths (the grouped strategy's view path)."""
    rng = np.random.default_rng(LOSSES.index(loss_fn) + (10 if lengths == "uniform" else 0))
    vocab = engine.info.vocab_size
    ids = [AdapterId(f"ref-{loss_fn}-{lengths}-{s.rank}") for s in SPECS]
    refs, works = [], []
    for k, (aid, spec) in enumerate(zip(ids, SPECS, strict=True)):
        engine.create_adapter(aid, spec)
        _give_b_values(engine, aid, seed=100 + k)
        model = _reference_model(tiny_model_dir, spec, _factors(engine, aid))
        refs.append(model)
        sizes = [int(x) for x in rng.integers(3, 19, size=2)] if lengths == "ragged" else [12, 12]
        works.append(ForwardBackwardWork(aid, _data(rng, model, loss_fn, vocab, sizes), loss_fn, LOSS_CONFIG))

    results = engine.forward_backward(works)
    assert engine.stats.adapters_per_pass[-1] == len(SPECS), "all adapters must share one pass"

    for aid, model, work, result in zip(ids, refs, works, results, strict=True):
        assert isinstance(result, ForwardBackwardResult), result
        total = 0.0
        for datum, out in zip(work.data, result.outputs, strict=True):
            lp = reference_logprobs(model, datum.tokens, datum.loss_inputs["target_tokens"])
            elementwise = reference_loss(loss_fn, lp, datum.loss_inputs, LOSS_CONFIG)
            np.testing.assert_allclose(out.logprobs, lp.detach().numpy(), atol=1e-5, rtol=0)
            # A per-token loss can be ~15x as sensitive to its logprob as 1 (cispo/ppo: ratio * lp * advantage),
            # so beyond |loss| ~ 5 the bound is fp32's relative precision (2e-6 = ~16 ulp), as for loss:sum.
            np.testing.assert_allclose(out.elementwise_loss, elementwise.detach().numpy(), atol=1e-5, rtol=2e-6)
            loss = elementwise.sum()
            loss.backward()
            total += float(loss.detach())
        # fp32 sums of ~30 terms: compare the total at float precision (~1e-6 relative).
        assert result.metrics["loss:sum"] == pytest.approx(total, rel=2e-6, abs=1e-5)
        ref_grads = lora_grads(model)
        ours = engine.adapter(aid).grads()
        assert set(ref_grads) == set(engine.adapter(aid).params) == set(ours)
        for key, g_ref in ref_grads.items():
            g = ours[key]
            err = float((g - g_ref).norm() / g_ref.norm().clamp_min(1e-12))
            assert err <= 1e-4, f"{aid} {key}: relative gradient error {err:.2e}"
        engine.drop_adapter(aid)


def test_topk_targets_forward_only_and_base_share_a_pass(engine: Engine, tiny_model_dir) -> None:  # noqa: ANN001
    """(T, K) distillation targets with signed weights, a forward-only request and a base-model forward."""
    rng = np.random.default_rng(7)
    vocab = engine.info.vocab_size
    spec = LoraSpec(rank=8, seed=3)
    trained, frozen = AdapterId("topk-train"), AdapterId("topk-forward")
    for aid in (trained, frozen):
        engine.create_adapter(aid, spec)
        _give_b_values(engine, aid, seed=5)
    n, k = 9, 3
    tokens = rng.integers(0, vocab, n).astype(np.int64)
    targets = rng.integers(0, vocab, (n, k)).astype(np.int64)
    weights = rng.normal(0, 1, (n, k)).astype(np.float32)
    datum = Datum(tokens, {"target_tokens": targets, "weights": weights})
    works = [
        ForwardBackwardWork(trained, [datum], "cross_entropy"),
        ForwardBackwardWork(frozen, [datum], "cross_entropy", forward_only=True),
        ForwardBackwardWork(None, [datum], "cross_entropy", forward_only=True),
    ]
    res_train, res_frozen, res_base = engine.forward_backward(works)
    model = _reference_model(tiny_model_dir, spec, _factors(engine, trained))
    lp = reference_logprobs(model, tokens, targets)
    np.testing.assert_allclose(res_train.outputs[0].logprobs, lp.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(res_frozen.outputs[0].logprobs, lp.detach().numpy(), atol=1e-5)
    (-(torch.as_tensor(weights) * lp)).sum().backward()
    grads = engine.adapter(trained).grads()
    for key, g_ref in lora_grads(model).items():
        assert float((grads[key] - g_ref).norm() / g_ref.norm()) <= 1e-4, key
    assert engine.adapter(frozen).grads() == {}
    base = peft_model(tiny_model_dir, 8, 32.0, {k: torch.zeros_like(v) for k, v in _factors(engine, trained).items()})
    np.testing.assert_allclose(res_base.outputs[0].logprobs,
                               reference_logprobs(base, tokens, targets).detach().numpy(), atol=1e-5)
