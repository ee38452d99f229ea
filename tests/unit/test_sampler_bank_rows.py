"""Sampling adapters that share a bank in scattered rows: the grouped LoRA path reads their factors with a
gather from the bank, done once per sample batch (the decode steps share it), never stale.

Four adapters of one rank live in rows 0-3 of one bank; a batch asks for rows 2, 0 and 3 (not consecutive,
not in row order), with different `max_tokens` so rows leave the decode at different steps. Every returned
logprob must equal an independent transformers + peft forward pass over the sampled tokens (fp32, 1e-4),
and a batch must gather each layer's factors once per set of rows, not once per decode step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.domain.sampling import SampleResult, SampleWork, SamplingParams
from services.domain.training import AdapterId, LoraSpec
from tests.reference.peft_reference import peft_model, reference_logprobs
from worker.engine.engine import Engine, EngineConfig

TOL = 1e-4
IDS = [AdapterId(f"bank-{i}") for i in range(4)]
ASKED = [IDS[2], IDS[0], IDS[3]]
RANK = 4


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    engine = Engine(tiny_model_dir, name="tiny", config=EngineConfig(device="cpu", dtype="float32"))
    for i, aid in enumerate(IDS):
        engine.create_adapter(aid, LoraSpec(rank=RANK, seed=40 + i))
        gen = torch.Generator().manual_seed(300 + i)  # fresh B is 0: make each adapter its own model
        with torch.no_grad():
            for key, p in engine.adapter(aid).params.items():
                if key.endswith("lora_B"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    placements = [engine.adapter(aid).placement for aid in IDS]
    assert all(p is not None and p.bank is placements[0].bank for p in placements)  # type: ignore[union-attr]
    return engine


def _works() -> list[SampleWork]:
    rng = np.random.default_rng(5)
    return [SampleWork(aid, rng.integers(0, 512, 4 + i).astype(np.int64), num_samples=2,
                       params=SamplingParams(max_tokens=4 + 3 * i, temperature=1.0, seed=i))
            for i, aid in enumerate(ASKED)]


def test_scattered_rows_sample_what_each_adapter_alone_gives(engine: Engine, tiny_model_dir: Path) -> None:
    results = engine.sample(_works())
    for work, result in zip(_works(), results, strict=True):
        assert isinstance(result, SampleResult), result
        state = engine.adapter(work.adapter_id)  # type: ignore[arg-type]
        factors = {k: p.detach().clone() for k, p in state.params.items()}
        reference = peft_model(tiny_model_dir, RANK, state.spec.alpha, factors)
        for seq in result.sequences:
            assert len(seq.tokens) == work.params.max_tokens
            full = np.concatenate([work.prompt, np.asarray(seq.tokens, dtype=np.int64)])
            with torch.no_grad():
                expected = reference_logprobs(reference, full[:-1], full[1:])[len(work.prompt) - 1 :]
            assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=TOL, rtol=0)


def test_a_batch_gathers_bank_rows_once_per_set_of_rows(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    bank_stacks = {id(layer.A) for layer in engine.adapter(IDS[0]).placement.layers.values()}  # type: ignore[union-attr]
    bank_stacks |= {id(layer.B) for layer in engine.adapter(IDS[0]).placement.layers.values()}  # type: ignore[union-attr]
    gathers: list[int] = []
    original = torch.Tensor.index_select

    def counting(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        if id(self) in bank_stacks:
            gathers.append(id(self))
        return original(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", counting)
    engine.sample(_works())
    # Rows leave at steps 4, 7 and 10: the prefill and three sets of rows, each gathered once per stack.
    steps = max(w.params.max_tokens for w in _works())
    assert 0 < len(gathers) <= 4 * len(bank_stacks) < steps * len(bank_stacks)


def test_decode_steps_work_out_each_layers_route_once_per_set_of_rows(engine: Engine,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's decode steps share one pass plan while no row leaves: each layer works out its segments,
    layout and stacked factors once per plan (the prefill's, then one per set of rows), not once per step."""
    from worker.engine import lora

    routed: list[str] = []
    original = lora._route

    def counting(plan: object, layer: str, *args: object) -> object:
        routed.append(layer)
        return original(plan, layer, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(lora, "_route", counting)
    results = engine.sample(_works())
    layers = len(set(routed))
    lengths = {len(seq.tokens) for result in results if isinstance(result, SampleResult) for seq in result.sequences}
    plans = 1 + len(lengths)  # the prefill's, then one per set of rows (a set ends when some rows stop)
    steps = max(w.params.max_tokens for w in _works())
    assert len(lengths) == 3 and layers > 0
    assert len(routed) == plans * layers < steps * layers
