"""Bad requests in a packed call come back as per-request errors naming the field; the others still run."""

from __future__ import annotations

import numpy as np
import pytest

from services.domain.training import AdapterId, Datum, ForwardBackwardResult, ForwardBackwardWork, LoraSpec, WorkError
from worker.engine.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:  # noqa: ANN001
    e = Engine(tiny_model_dir, name="tiny", config=EngineConfig(device="cpu", max_tokens_per_pass=64))
    e.create_adapter(AdapterId("ok"), LoraSpec(rank=4, seed=0))
    return e


def _datum(n: int, vocab: int = 500) -> Datum:
    seq = np.arange(n + 1, dtype=np.int64) % vocab
    return Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(n, np.float32)})


BAD = {
    "token outside the vocabulary": (
        ForwardBackwardWork(AdapterId("ok"), [Datum(np.array([1, 99999]), {"target_tokens": np.array([2, 3]),
                                                                            "weights": np.ones(2, np.float32)})]),
        "data[0].model_input: token id 99999 is outside the vocabulary"),
    "targets misaligned": (
        ForwardBackwardWork(AdapterId("ok"), [Datum(np.array([1, 2, 3]), {"target_tokens": np.array([2, 3]),
                                                                           "weights": np.ones(2, np.float32)})]),
        "data[0].loss_fn_inputs.target_tokens: shape (2,)"),
    "missing advantages": (
        ForwardBackwardWork(AdapterId("ok"), [Datum(np.array([1, 2]), {"target_tokens": np.array([2, 3]),
                                                                        "logprobs": np.zeros(2, np.float32)})],
                            loss_fn="ppo"),
        "data[0].loss_fn_inputs.advantages: is required"),
    "unknown loss": (ForwardBackwardWork(AdapterId("ok"), [_datum(4)], loss_fn="nope"), "loss_fn: unknown loss"),
    "unknown adapter": (ForwardBackwardWork(AdapterId("ghost"), [_datum(4)]), "adapter 'ghost' does not exist"),
    "over the token budget": (ForwardBackwardWork(AdapterId("ok"), [_datum(65)]),
                              "65 tokens exceed the per-pass token budget of 64"),
    "training the frozen base": (ForwardBackwardWork(None, [_datum(4)]), "the base model is frozen"),
    "nan weights": (
        ForwardBackwardWork(AdapterId("ok"), [Datum(np.array([1, 2]), {"target_tokens": np.array([2, 3]),
                                                                        "weights": np.array([1, np.nan],
                                                                                            np.float32)})]),
        "data[0].loss_fn_inputs.weights: must be finite"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_an_error_result_and_neighbours_still_train(engine: Engine, case: str) -> None:
    bad, message = BAD[case]
    good = ForwardBackwardWork(AdapterId("ok"), [_datum(8)])
    before = engine.stats.passes
    result_bad, result_good = engine.forward_backward([bad, good])
    assert isinstance(result_bad, WorkError) and result_bad.category == "user"
    assert message in result_bad.message, result_bad.message
    assert isinstance(result_good, ForwardBackwardResult)
    assert engine.stats.passes == before + 1


def test_many_datums_over_the_budget_run_as_micro_batches(engine: Engine) -> None:
    """Only a single datum longer than the budget is an error; a large batch is split into passes."""
    before = engine.stats.passes
    (result,) = engine.forward_backward([ForwardBackwardWork(AdapterId("ok"), [_datum(40) for _ in range(5)])])
    assert isinstance(result, ForwardBackwardResult) and len(result.outputs) == 5
    assert engine.stats.passes - before == 5
