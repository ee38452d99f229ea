"""gspo, stable_reinforce and (N, K) cross_entropy against independent references, values and gradients.

References are written from the formulas in numpy, with hand-derived gradients (no autograd), so a sign or
a detach in the torch implementation cannot hide in both. The engine checks then train one adapter with
each loss alone and packed beside other tenants' losses: the reported loss equals the reference on the
pass's own logprobs, and the gradient that reached the adapter equals the reference gradient (the same
adapter trained with `cross_entropy` and weights = -dL/dlogprobs, the SDK's own surrogate, ends equal).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.domain.training import AdamParams, AdapterId, Datum, ForwardBackwardResult, ForwardBackwardWork, LoraSpec
from worker.engine.engine import Engine, EngineConfig
from worker.engine.losses import gspo, stable_reinforce

LO, HI = 0.8, 1.2


def gspo_reference(lp: np.ndarray, q: np.ndarray, adv: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Elementwise loss and d(sum loss)/d lp of token-level GSPO with PPO clipping."""
    s = float(np.exp(np.sum(mask * (lp - q)) / max(float(mask.sum()), 1.0)))
    clipped = min(max(s, LO), HI)
    unclipped_term, clipped_term = s * adv, clipped * adv
    loss = -np.minimum(unclipped_term, clipped_term)
    # The min takes the unclipped branch (gradient -A * s through the token's own logprob) where it is smaller.
    grad = np.where(unclipped_term <= clipped_term, -adv * s, 0.0)
    return loss, grad


def stable_reinforce_reference(lp: np.ndarray, q: np.ndarray, adv: np.ndarray, cap: float,
                               kl: float) -> tuple[np.ndarray, np.ndarray]:
    w = np.minimum(np.exp(lp - q), cap)
    return -w * adv * lp + 0.5 * kl * (lp - q) ** 2, -w * adv + kl * (lp - q)


def _grad(fn, lp: np.ndarray, inputs: dict[str, np.ndarray], config: dict[str, float]):  # type: ignore[no-untyped-def]
    x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    out = fn(x, {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}, config)
    out.sum().backward()
    assert x.grad is not None
    return out.detach().numpy(), x.grad.numpy()


@pytest.mark.parametrize("seed", range(4))
def test_gspo_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 12
    lp = rng.normal(-2, 0.3, n)
    q = lp + rng.normal(0, 0.2 * (seed + 1), n)  # seeds 2-3 push the sequence ratio past the clip range
    adv = rng.normal(0, 1, n)
    mask = (rng.random(n) > 0.3).astype(np.float64)
    value, grad = _grad(gspo, lp, {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask},
                        {"clip_low_threshold": LO, "clip_high_threshold": HI})
    ref_value, ref_grad = gspo_reference(lp, q, adv, mask)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_gspo_without_mask_uses_every_token_and_ratio_is_per_sequence() -> None:
    rng = np.random.default_rng(7)
    lp, q, adv = rng.normal(-2, 0.1, 6), rng.normal(-2, 0.1, 6), rng.normal(0, 1, 6)
    value, _ = _grad(gspo, lp, {"logprobs": q, "advantages": adv}, {})
    np.testing.assert_allclose(value, gspo_reference(lp, q, adv, np.ones(6))[0], rtol=1e-10)
    # Every token carries the same (sequence-level) ratio: loss / -A is constant where unclipped.
    ratios = value / -adv
    assert np.ptp(ratios[np.isclose(ratios, ratios[0])]) < 1e-12


@pytest.mark.parametrize(("cap", "kl"), [(2.0, 0.0), (1.1, 0.3)])
def test_stable_reinforce_matches_reference(cap: float, kl: float) -> None:
    rng = np.random.default_rng(3)
    lp = rng.normal(-2, 0.5, 16)
    q = lp + rng.normal(0, 0.5, 16)
    adv = rng.normal(0, 1, 16)
    value, grad = _grad(stable_reinforce, lp, {"logprobs": q, "advantages": adv},
                        {"clip_high_threshold": cap, "kl_coeff": kl})
    ref_value, ref_grad = stable_reinforce_reference(lp, q, adv, cap, kl)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)


# -- in the engine: solo == packed, gradients reach the adapter -------------------------------------------
# Adam with lr == eps >> |g| makes the first update ~= -g (m_hat = g, v_hat = g^2): parameters then expose
# the gradient the adapter received, so two engines agree only if their gradients do.
PROBE = AdamParams(learning_rate=1e3, eps=1e3, beta1=0.9, beta2=0.95)
X = AdapterId("x")


def _engine(model_dir: Path) -> Engine:
    engine = Engine(model_dir, name="t", config=EngineConfig(device="cpu", dtype="float32", lora_strategy="loop"))
    engine.create_adapter(X, LoraSpec(rank=4, seed=11))
    return engine


def _rl_datum(rng: np.random.Generator, vocab: int, n: int, *, topk: int = 0) -> Datum:
    seq = rng.integers(0, vocab, n + 1)
    targets = seq[1:] if not topk else np.stack([seq[1:], *(rng.integers(0, vocab, n) for _ in range(topk - 1))], 1)
    return Datum(seq[:-1], {
        "target_tokens": targets.astype(np.int64),
        "weights": rng.random(targets.shape).astype(np.float32),
        "logprobs": rng.normal(-6.2, 0.05, n).astype(np.float32),
        "advantages": rng.normal(0, 1, n).astype(np.float32),
        "sequence_ratio_mask": (rng.random(n) > 0.2).astype(np.float32),
    })


def _reference(loss_fn: str, datum: Datum, lp: np.ndarray) -> tuple[float, np.ndarray]:
    li = {k: np.asarray(v, np.float64) for k, v in datum.loss_inputs.items() if k != "target_tokens"}
    lp = lp.astype(np.float64)
    if loss_fn == "gspo":
        value, grad = gspo_reference(lp, li["logprobs"], li["advantages"], li["sequence_ratio_mask"])
    elif loss_fn == "stable_reinforce":
        value, grad = stable_reinforce_reference(lp, li["logprobs"], li["advantages"], 2.0, 0.1)
    else:  # cross_entropy, (N, K) targets
        value, grad = -li["weights"] * lp, -li["weights"]
    return float(value.sum()), grad


def _others(rng: np.random.Generator, vocab: int) -> list[ForwardBackwardWork]:
    data = [_rl_datum(rng, vocab, 7) for _ in range(2)]
    return [ForwardBackwardWork(AdapterId("o1"), data[:1], "ppo"),
            ForwardBackwardWork(AdapterId("o2"), data[1:], "cross_entropy"),
            ForwardBackwardWork(AdapterId("o3"), [_rl_datum(rng, vocab, 5, topk=3)], "cross_entropy")]


@pytest.mark.parametrize("loss_fn", ["gspo", "stable_reinforce", "cross_entropy_topk"])
def test_loss_in_packed_pass_equals_solo_and_reference(tiny_model_dir: Path, loss_fn: str) -> None:
    rng = np.random.default_rng(5)
    solo, packed, surrogate = (_engine(tiny_model_dir) for _ in range(3))
    for aid, rank in (("o1", 8), ("o2", 2), ("o3", 4)):
        packed.create_adapter(AdapterId(aid), LoraSpec(rank=rank, seed=rank))
    vocab = solo.info.vocab_size
    name = "cross_entropy" if loss_fn == "cross_entropy_topk" else loss_fn
    data = [_rl_datum(rng, vocab, n, topk=4 if name == "cross_entropy" else 0) for n in (9, 6)]
    config = {"kl_coeff": 0.1} if name == "stable_reinforce" else {}
    work = ForwardBackwardWork(X, data, name, config)

    alone = solo.forward_backward([work])[0]
    together = packed.forward_backward([*_others(rng, vocab)[:2], work, _others(rng, vocab)[2]])[2]
    assert isinstance(alone, ForwardBackwardResult) and isinstance(together, ForwardBackwardResult)
    assert together.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-5, abs=1e-6)
    for a, b in zip(alone.outputs, together.outputs, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)

    refs = [_reference(name, d, o.logprobs) for d, o in zip(data, alone.outputs, strict=True)]
    assert alone.metrics["loss:sum"] == pytest.approx(sum(r[0] for r in refs), rel=1e-5, abs=1e-5)
    # The same gradient through the SDK's surrogate: cross_entropy with weights = -dL/dlogprobs.
    surrogate_data = [Datum(d.tokens, {"target_tokens": d.loss_inputs["target_tokens"],
                                       "weights": (-g).astype(np.float32)})
                      for d, (_, g) in zip(data, refs, strict=True)]
    surrogate.forward_backward([ForwardBackwardWork(X, surrogate_data, "cross_entropy")])

    before = {k: p.detach().clone() for k, p in solo.adapter(X).params.items()}
    for engine in (solo, packed, surrogate):
        engine.optim_step(X, PROBE)
    expected = {k: p.detach() - before[k] for k, p in surrogate.adapter(X).params.items()}
    for engine in (solo, packed):
        for key, value in engine.adapter(X).params.items():
            torch.testing.assert_close(value.detach() - before[key], expected[key], rtol=1e-3, atol=2e-6)
    assert max(float(d.abs().max()) for d in expected.values()) > 1e-4  # the probe step did move X
