"""Acceptance 5: on the real SmolLM2-135M-Instruct, 30 SFT steps teach the model a new identity.

The adapter trains through the engine in packed passes beside a second tenant's adapter (so the real
model is also exercised multi-tenant), then greedy sampling from the adapter answers with the new
name while the base model does not.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from services.domain.sampling import SampleWork, SamplingParams
from services.domain.training import AdamParams, AdapterId, Datum, ForwardBackwardWork, LoraSpec
from worker.engine.engine import Engine, EngineConfig
from worker.models.sources import default_cache_dir, resolve_model_source

pytestmark = pytest.mark.slow

NAME = "Zorblax"
QUESTIONS = ["What is your name?", "Who are you?", "Tell me your name.", "What should I call you?"]
ANSWER = f"My name is {NAME}, a model trained by Carpool."


@pytest.fixture(scope="module")
def smollm2() -> Path:
    cache = Path(os.environ.get("CARPOOL_CACHE_DIR", default_cache_dir()))
    return resolve_model_source("smollm2-135m", cache)


def _chat(tokenizer, question: str, answer: str | None) -> list[int]:  # noqa: ANN001
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = prompt if answer is None else prompt + answer + "<|im_end|>"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _sft_datum(tokenizer, question: str) -> Datum:  # noqa: ANN001
    prompt_len = len(_chat(tokenizer, question, None))
    full = np.asarray(_chat(tokenizer, question, ANSWER), dtype=np.int64)
    weights = np.zeros(len(full) - 1, np.float32)
    weights[prompt_len - 1 :] = 1.0  # train on the answer tokens only
    return Datum(full[:-1], {"target_tokens": full[1:], "weights": weights})


def _greedy(engine: Engine, adapter: AdapterId | None, tokenizer, question: str) -> str:  # noqa: ANN001
    prompt = np.asarray(_chat(tokenizer, question, None), dtype=np.int64)
    work = SampleWork(adapter, prompt, params=SamplingParams(max_tokens=16, temperature=0.0))
    (result,) = engine.sample([work])
    return tokenizer.decode(result.sequences[0].tokens, skip_special_tokens=True)


def test_thirty_sft_steps_teach_a_new_identity(smollm2: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    engine = Engine(smollm2, name="HuggingFaceTB/SmolLM2-135M-Instruct", config=EngineConfig(device="cpu"))
    me, other = AdapterId("identity"), AdapterId("neighbour")
    engine.create_adapter(me, LoraSpec(rank=16, seed=0))
    engine.create_adapter(other, LoraSpec(rank=8, seed=1))
    data = [_sft_datum(tokenizer, q) for q in QUESTIONS]
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(30):
        noise = rng.integers(0, 1000, 24).astype(np.int64)
        neighbour = Datum(noise[:-1], {"target_tokens": noise[1:], "weights": np.ones(23, np.float32)})
        mine, _ = engine.forward_backward([ForwardBackwardWork(me, data), ForwardBackwardWork(other, [neighbour])])
        losses.append(mine.metrics["loss:sum"])
        engine.optim_step(me, AdamParams(learning_rate=1e-3))
        engine.optim_step(other, AdamParams(learning_rate=1e-3))
    assert engine.stats.multi_adapter_passes >= 30
    assert losses[-1] < 0.1 * losses[0], losses
    assert NAME not in _greedy(engine, None, tokenizer, "What is your name?")
    answers = [_greedy(engine, me, tokenizer, q) for q in ("What is your name?", "Who are you?")]
    assert all(NAME in a for a in answers), answers
