"""Temperature and top-p draws follow the distribution they claim: a chi-square test on a fixed seed.

The sampler (worker/engine/sampler.py) draws a row's next token as the argmax of its filtered logits plus
Gumbel noise from the row's own seeded generator. Here many rows with one set of logits are drawn at once,
each with the generator the sampler gives sample `j` of a seeded request, and the counts are compared
with the distribution computed independently in numpy: softmax(logits / T), cut to the smallest set of
most likely tokens whose mass reaches top_p, renormalised. The seed is fixed, so the outcome is too; the
threshold is the chi-square 99.9 % quantile, so a correct sampler would fail on a fresh seed once in a
thousand, and a sampler off by a few percent on any token fails every time.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.domain.sampling import SamplingParams
from worker.engine.sampler import _choose, _generator, _Row, _stops

LOGITS = np.array([2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -1.0, -2.0, -4.0])
DRAWS = 10_000
Z_999 = 3.090232  # the standard normal's 99.9 % quantile


def expected_distribution(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The sampling distribution in plain numpy (the reference, written apart from the sampler)."""
    scaled = logits / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    kept = np.zeros_like(probs, dtype=bool)
    kept[order[mass_before < top_p]] = True  # the first token always stays
    out = np.where(kept, probs, 0.0)
    return out / out.sum()


def chi_square_999(df: int) -> float:
    """The chi-square 99.9 % quantile (Wilson-Hilferty; within a fraction of a percent for df ≥ 3)."""
    return df * (1 - 2 / (9 * df) + Z_999 * math.sqrt(2 / (9 * df))) ** 3


def draw(params: SamplingParams, n: int, rows: int = 250) -> np.ndarray:
    """`n` draws from LOGITS: `rows` samples of one request, seeded as the sampler seeds them, each drawing
    `n / rows` successive tokens from the same logits (as decoding steps do, each advancing its generator)."""
    batch = [_Row(params, _stops(params, ()), _generator(params, j, torch.device("cpu"))) for j in range(rows)]
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(rows, -1).contiguous()
    return np.concatenate([_choose(logits, batch).numpy() for _ in range(n // rows)])


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 1.0), (1.7, 1.0), (1.0, 0.8), (0.8, 0.5)])
def test_draws_follow_the_tempered_nucleus_distribution(temperature: float, top_p: float) -> None:
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, seed=1234)
    counts = np.bincount(draw(params, DRAWS), minlength=len(LOGITS))
    expected = expected_distribution(LOGITS, temperature, top_p) * DRAWS
    assert counts[expected == 0].sum() == 0, f"drew tokens top_p={top_p} excludes: {counts}"
    support = expected > 0
    statistic = float((((counts - expected) ** 2)[support] / expected[support]).sum())
    limit = chi_square_999(int(support.sum()) - 1)
    assert statistic < limit, f"chi-square {statistic:.1f} ≥ {limit:.1f}: counts {counts}, expected {expected.round()}"


def test_the_test_can_tell_a_wrong_temperature() -> None:
    """The same statistic rejects draws at temperature 1.0 judged against 1.15: the test has the power it
    needs to catch a temperature that is not applied or applied wrongly."""
    counts = np.bincount(draw(SamplingParams(max_tokens=1, temperature=1.0, seed=99), DRAWS), minlength=len(LOGITS))
    expected = expected_distribution(LOGITS, 1.15, 1.0) * DRAWS
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic > chi_square_999(len(LOGITS) - 1)
