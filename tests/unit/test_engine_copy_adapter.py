"""`Engine.copy_adapter`: a sampler's weights-only copy of a training adapter, made in memory.

The copy must hold exactly the source's factors at the time of the copy (snapshot semantics: the source
trains on, the copy does not move), sample exactly as the source did, live apart from the trainable
adapters' bank rows, and leave those rows consecutive however copies and creations interleave.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.domain.sampling import SampleResult, SampleWork, SamplingParams
from services.domain.training import AdamParams, AdapterId, Datum, ForwardBackwardWork, LoraSpec
from worker.engine.engine import Engine, EngineConfig

TENANTS = [AdapterId(f"tenant-{i}") for i in range(3)]


def _copy_id(aid: AdapterId) -> AdapterId:
    return AdapterId(f"{aid}-sampler")


def _datum(seed: int) -> Datum:
    seq = np.random.default_rng(seed).integers(0, 512, 9)
    return Datum(seq[:-1].astype(np.int64), {"target_tokens": seq[1:].astype(np.int64),
                                             "weights": np.ones(8, np.float32)})


def _factors(engine: Engine, aid: AdapterId) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in engine.adapter(aid).params.items()}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    engine = Engine(tiny_model_dir, name="tiny", config=EngineConfig(device="cpu", dtype="float32"))
    for i, aid in enumerate(TENANTS):  # as tenants do: create, train a step, take a sampler, next tenant
        engine.create_adapter(aid, LoraSpec(rank=4, seed=i))
        engine.forward_backward([ForwardBackwardWork(aid, [_datum(i)])])
        engine.optim_step(aid, AdamParams(learning_rate=1e-2))
        engine.copy_adapter(aid, _copy_id(aid))
    return engine


def test_copies_hold_the_source_factors_and_stay_put_while_it_trains(engine: Engine) -> None:
    aid = TENANTS[0]
    copied = _factors(engine, _copy_id(aid))
    assert copied.keys() == _factors(engine, aid).keys()
    for key, value in _factors(engine, aid).items():
        assert torch.equal(copied[key], value), key
    engine.forward_backward([ForwardBackwardWork(aid, [_datum(7)])])
    engine.optim_step(aid, AdamParams(learning_rate=1e-2))
    engine.apply_pending_steps()
    after = _factors(engine, _copy_id(aid))
    assert all(torch.equal(after[k], copied[k]) for k in copied)
    assert any(not torch.equal(_factors(engine, aid)[k], copied[k]) for k in copied)


def test_trainable_rows_stay_consecutive_and_copies_live_apart(engine: Engine) -> None:
    placed = [engine.adapter(aid).placement for aid in TENANTS]
    copies = [engine.adapter(_copy_id(aid)).placement for aid in TENANTS]
    assert all(p is not None for p in placed + copies)
    assert [p.slot for p in placed if p is not None] == [0, 1, 2]
    assert {id(p.bank) for p in copies if p is not None}.isdisjoint({id(p.bank) for p in placed if p is not None})
    assert all(engine.adapter(_copy_id(aid)).sampling_only for aid in TENANTS)
    assert not any(engine.adapter(aid).sampling_only for aid in TENANTS)


def test_a_copy_samples_as_its_source_did(tiny_model_dir: Path) -> None:
    engine = Engine(tiny_model_dir, name="tiny", config=EngineConfig(device="cpu", dtype="float32"))
    aid = AdapterId("source")
    engine.create_adapter(aid, LoraSpec(rank=4, seed=3))
    with torch.no_grad():  # a fresh B is 0: give the adapter an effect of its own
        gen = torch.Generator().manual_seed(11)
        for key, p in engine.adapter(aid).params.items():
            if key.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    engine.copy_adapter(aid, _copy_id(aid))
    prompt = np.arange(3, 9, dtype=np.int64)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    out = engine.sample([SampleWork(a, prompt, num_samples=2, params=params) for a in (aid, _copy_id(aid))])
    assert all(isinstance(r, SampleResult) for r in out)
    source, copy = out
    assert isinstance(source, SampleResult) and isinstance(copy, SampleResult)
    for a, b in zip(source.sequences, copy.sequences, strict=True):
        assert list(a.tokens) == list(b.tokens)
        # Same factors, different banks: the batch reads them through different grouped layouts (fp32 sums
        # in another order), so equal to rounding, not bit for bit.
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
