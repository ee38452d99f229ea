"""Sampling acceptance: batched, padded, multi-adapter decoding equals transformers + peft one at a time.

Every test goes through `Engine.sample` with requests of several adapters (and the base) and of
different prompt lengths in one batch, so left padding, the KV cache and mixed LoRA segments are always
exercised. References are independent: peft models built from the engine adapters' factors, with
transformers' own `generate` and forward. Tolerances (fp32, CPU): logprobs within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.domain.sampling import SampleResult, SampleWork, SamplingParams
from services.domain.training import AdapterId, LoraSpec, WorkError
from tests.reference.peft_reference import peft_model, reference_logprobs
from worker.engine.engine import Engine, EngineConfig

TOL = 1e-4
SPECS = {
    AdapterId("s-a"): LoraSpec(rank=4, seed=21),
    AdapterId("s-b"): LoraSpec(rank=8, seed=22, train_unembed=False),
}
A, B = SPECS


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    engine = Engine(tiny_model_dir, name="tiny", config=EngineConfig(device="cpu", dtype="float32"))
    for k, (aid, spec) in enumerate(SPECS.items()):
        engine.create_adapter(aid, spec)
        _give_b_values(engine, aid, seed=200 + k)
    return engine


@pytest.fixture(scope="module")
def references(engine: Engine, tiny_model_dir: Path) -> dict[AdapterId | None, torch.nn.Module]:
    """One independent model per adapter (peft) and for the base (plain transformers)."""
    refs: dict[AdapterId | None, torch.nn.Module] = {}
    for aid, spec in SPECS.items():
        factors = {k: p.detach().clone() for k, p in engine.adapter(aid).params.items()}
        refs[aid] = peft_model(tiny_model_dir, spec.rank, spec.alpha, factors, spec.train_attn,
                               spec.train_mlp, spec.train_unembed)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                attn_implementation="eager")
    refs[None] = base.eval()
    return refs


def _give_b_values(engine: Engine, aid: AdapterId, seed: int) -> None:
    """Fresh adapters have B = 0 (they equal the base); random B makes each adapter its own model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in engine.adapter(aid).params.items():
            if key.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, n).astype(np.int64)


def _ok(result: SampleResult | WorkError) -> SampleResult:
    assert isinstance(result, SampleResult), result
    return result


def _sample_one(engine: Engine, work: SampleWork, *others: SampleWork) -> SampleResult:
    """`work`'s result when it shares the batch with `others` (placed around it)."""
    half = len(others) // 2
    results = engine.sample([*others[:half], work, *others[half:]])
    return _ok(results[half])


def _others(seed: int) -> list[SampleWork]:
    """Filler requests of other adapters and lengths, sampled with temperature."""
    return [
        SampleWork(B, _prompt(seed, 3), num_samples=2, params=SamplingParams(max_tokens=5, seed=seed)),
        SampleWork(None, _prompt(seed + 1, 11), params=SamplingParams(max_tokens=9, temperature=0.7)),
        SampleWork(A, _prompt(seed + 2, 6), params=SamplingParams(max_tokens=3, top_k=5)),
    ]


def _reference_step_logprobs(model: torch.nn.Module, prompt: np.ndarray, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | prompt + tokens[:i]) from one plain forward pass."""
    full = np.concatenate([prompt, np.asarray(tokens, dtype=np.int64)])
    with torch.no_grad():
        lp = reference_logprobs(model, full[:-1], full[1:])
    return lp[len(prompt) - 1 :]


# -- 1. greedy equals transformers' generate ------------------------------------------------------
def test_greedy_equals_generate_in_a_mixed_batch(engine: Engine, references: dict) -> None:  # noqa: ANN001
    n_new = 12
    greedy = SamplingParams(max_tokens=n_new, temperature=0.0)
    works = [SampleWork(A, _prompt(1, 7), params=greedy), SampleWork(None, _prompt(2, 13), params=greedy),
             SampleWork(B, _prompt(3, 2), num_samples=2, params=greedy)]
    results = engine.sample([works[0], _others(5)[0], works[1], _others(6)[1], works[2]])
    for work, result in zip(works, [results[0], results[2], results[4]], strict=True):
        ids = torch.as_tensor(work.prompt)[None]
        with torch.no_grad():
            out = references[work.adapter_id].generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                       max_new_tokens=n_new, do_sample=False)
        expected = out[0, len(work.prompt):].tolist()
        for seq in _ok(result).sequences:
            assert seq.tokens == expected
            assert seq.stop_reason == ("length" if len(expected) == n_new else "stop")


# -- 2. returned logprobs equal a forward pass over the sampled tokens ----------------------------
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=1.0, seed=1),
    SamplingParams(max_tokens=10, temperature=1.7, top_k=20, top_p=0.9, seed=2),
])
def test_logprobs_equal_a_forward_pass(engine: Engine, references: dict, params: SamplingParams) -> None:  # noqa: ANN001
    for aid in (A, B):
        work = SampleWork(aid, _prompt(7, 9), num_samples=2, params=params)
        result = _sample_one(engine, work, *_others(8))
        for seq in result.sequences:
            ref = _reference_step_logprobs(references[aid], work.prompt, seq.tokens)
            assert len(seq.logprobs) == len(seq.tokens)
            assert torch.allclose(torch.tensor(seq.logprobs), ref, atol=TOL, rtol=0)


def test_top_k_keeps_sampled_tokens_in_the_top_k(engine: Engine, references: dict) -> None:  # noqa: ANN001
    work = SampleWork(A, _prompt(9, 5), num_samples=3, params=SamplingParams(max_tokens=12, top_k=3, seed=4))
    for seq in _sample_one(engine, work, *_others(10)).sequences:
        full = np.concatenate([work.prompt, np.asarray(seq.tokens)])
        with torch.no_grad():
            logits = references[A](input_ids=torch.as_tensor(full)[None]).logits[0, len(work.prompt) - 1 : -1]
        top3 = logits.topk(3, dim=-1).indices
        assert all(tok in top3[i].tolist() for i, tok in enumerate(seq.tokens))


@pytest.mark.parametrize("params", [SamplingParams(top_k=1, seed=3), SamplingParams(top_p=1e-6, seed=3)])
def test_narrowest_filters_are_greedy(engine: Engine, params: SamplingParams) -> None:
    prompt = _prompt(11, 6)
    greedy = _sample_one(engine, SampleWork(B, prompt, params=SamplingParams(temperature=0.0, stop=())))
    narrow = _sample_one(engine, SampleWork(B, prompt, params=SamplingParams(
        temperature=2.0, top_k=params.top_k, top_p=params.top_p, seed=3, stop=())), *_others(12))
    assert narrow.sequences[0].tokens == greedy.sequences[0].tokens


# -- 3. seeds -------------------------------------------------------------------------------------
def test_fixed_seed_reproduces_and_seeds_differ(engine: Engine) -> None:
    def run(seed: int, *others: SampleWork) -> list[list[int]]:
        work = SampleWork(A, _prompt(13, 8), num_samples=2, params=SamplingParams(max_tokens=10, seed=seed,
                                                                                  stop=()))
        return [s.tokens for s in _sample_one(engine, work, *others).sequences]

    first = run(42)
    assert run(42) == first
    assert run(42, *_others(14)) == first
    assert run(42, *_others(15)[:2]) == first
    assert first[0] != first[1]  # the samples of one request differ
    assert run(43) != first


def test_unseeded_requests_differ(engine: Engine) -> None:
    work = SampleWork(None, _prompt(16, 4), num_samples=2, params=SamplingParams(max_tokens=10, stop=()))
    a, b = _ok(engine.sample([work])[0]).sequences
    assert a.tokens != b.tokens


# -- 4. stops, prompt logprobs, errors ------------------------------------------------------------
def _first_new_index(tokens: list[int]) -> int:
    """An index k >= 2 whose token does not appear before k (so stopping on it stops exactly there)."""
    return next(k for k in range(2, len(tokens)) if tokens[k] not in tokens[:k])


def test_stop_token_id_stops_and_is_included(engine: Engine) -> None:
    params = SamplingParams(max_tokens=16, seed=5, stop=())
    prompt = _prompt(17, 5)
    full = _sample_one(engine, SampleWork(A, prompt, params=params)).sequences[0]
    k = _first_new_index(full.tokens)
    stop = SamplingParams(max_tokens=16, seed=5, stop=(full.tokens[k],))
    seq = _sample_one(engine, SampleWork(A, prompt, params=stop), *_others(18)).sequences[0]
    assert seq.tokens == full.tokens[: k + 1]
    assert seq.logprobs == pytest.approx(full.logprobs[: k + 1], abs=TOL)
    assert seq.stop_reason == "stop"


def test_eos_stops_only_when_stop_is_none(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = _prompt(19, 6)
    full = _sample_one(engine, SampleWork(None, prompt, params=SamplingParams(max_tokens=12, seed=6,
                                                                               stop=()))).sequences[0]
    assert len(full.tokens) == 12 and full.stop_reason == "length"
    k = _first_new_index(full.tokens)
    # Pretend the token at k is the model's EOS: `stop=None` stops there, `stop=()` runs to max_tokens.
    monkeypatch.setattr(engine.lm, "eos_token_ids", (full.tokens[k],))
    default = SampleWork(None, prompt, params=SamplingParams(max_tokens=12, seed=6))
    no_stop = SampleWork(None, prompt, params=SamplingParams(max_tokens=12, seed=6, stop=()))
    stopped, unstopped = (_ok(r).sequences[0] for r in engine.sample([default, no_stop]))
    assert stopped.tokens == full.tokens[: k + 1] and stopped.stop_reason == "stop"
    assert unstopped.tokens == full.tokens and unstopped.stop_reason == "length"


def test_stop_string_stops_after_the_token_that_completes_it(engine: Engine, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = _prompt(20, 7)
    params = SamplingParams(max_tokens=24, seed=7, stop=())
    full = _sample_one(engine, SampleWork(B, prompt, params=params)).sequences[0].tokens
    text = tokenizer.decode(full, skip_special_tokens=False)
    stop = next(s for k in range(4, len(full) - 1)
                if (s := tokenizer.decode(full[k : k + 2]).strip()) and "\ufffd" not in s and s in text)
    # The expected cut comes from decoding every prefix in full, independently of the sampler's window.
    cut = next(m for m in range(1, len(full) + 1)
               if stop in tokenizer.decode(full[:m], skip_special_tokens=False))
    work = SampleWork(B, prompt, params=SamplingParams(max_tokens=24, seed=7, stop=(stop, "never-seen-xyz")))
    seq = _sample_one(engine, work, *_others(21)).sequences[0]
    assert seq.tokens == full[:cut]
    assert seq.stop_reason == "stop"


def test_prompt_logprobs_match_a_forward_pass(engine: Engine, references: dict) -> None:  # noqa: ANN001
    # compute_logprobs in the SDK: max_tokens=1 and prompt_logprobs=True.
    works = [SampleWork(aid, _prompt(22 + i, n), params=SamplingParams(max_tokens=1), prompt_logprobs=True,
                        topk_prompt_logprobs=4) for i, (aid, n) in enumerate([(A, 9), (None, 4), (B, 14)])]
    results = engine.sample([works[0], _others(25)[0], works[1], works[2]])
    for work, result in zip(works, [results[0], results[2], results[3]], strict=True):
        res = _ok(result)
        assert len(res.sequences[0].tokens) == 1 and res.sequences[0].stop_reason in ("length", "stop")
        assert res.prompt_logprobs is not None and res.topk_prompt_logprobs is not None
        assert len(res.prompt_logprobs) == len(work.prompt) and res.prompt_logprobs[0] is None
        with torch.no_grad():
            ref = reference_logprobs(references[work.adapter_id], work.prompt[:-1], work.prompt[1:])
        assert torch.allclose(torch.tensor(res.prompt_logprobs[1:]), ref, atol=TOL, rtol=0)
        _check_topk(res, references[work.adapter_id], work.prompt, k=4)


def _check_topk(res: SampleResult, model: torch.nn.Module, prompt: np.ndarray, k: int) -> None:
    assert res.topk_prompt_logprobs is not None and res.prompt_logprobs is not None
    assert len(res.topk_prompt_logprobs) == len(prompt) and res.topk_prompt_logprobs[0] is None
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.as_tensor(prompt)[None]).logits[0, :-1], dim=-1)
    for i, pairs in enumerate(res.topk_prompt_logprobs[1:], start=1):
        assert pairs is not None and len(pairs) == k
        values = [lp for _, lp in pairs]
        assert values == sorted(values, reverse=True)
        ref = logp[i - 1].topk(k)
        assert [t for t, _ in pairs] == ref.indices.tolist()
        assert torch.allclose(torch.tensor(values), ref.values, atol=TOL, rtol=0)
        actual = res.prompt_logprobs[i]
        assert actual is not None and actual <= values[0] + TOL
        for token, lp in pairs:
            if token == int(prompt[i]):
                assert lp == pytest.approx(actual, abs=TOL)


def test_invalid_requests_fail_alone(engine: Engine) -> None:
    good = SampleWork(A, _prompt(26, 5), params=SamplingParams(max_tokens=4, seed=1, stop=()))
    bad_token = SampleWork(B, np.array([1, 2, 512], dtype=np.int64))
    bad_params = SampleWork(None, _prompt(27, 3), params=SamplingParams(top_p=0.0))
    unknown = SampleWork(AdapterId("nobody"), _prompt(28, 3))
    results = engine.sample([bad_token, good, bad_params, unknown, *_others(29)])
    assert isinstance(results[0], WorkError) and results[0].category == "user" and "512" in results[0].message
    assert isinstance(results[2], WorkError) and "top_p" in results[2].message
    assert isinstance(results[3], WorkError) and "nobody" in results[3].message
    assert len(_ok(results[1]).sequences[0].tokens) == 4
    assert all(isinstance(r, SampleResult) for r in results[4:])


def test_sampling_never_touches_adapter_grads(engine: Engine) -> None:
    engine.sample([SampleWork(A, _prompt(30, 4)), SampleWork(B, _prompt(31, 6), num_samples=2)])
    for aid in SPECS:
        state = engine.adapter(aid)
        assert state.grads() == {} and all(p.grad is None for p in state.params.values())
