"""A minimal RL loop through the unmodified `tinker` SDK: sample → reward → `importance_sampling` step.

Start a server (`make run`), create a tenant (`.venv/bin/carpool tenants create me`), then:

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python examples/rl.py

Every iteration samples a group of answers to one question from the current weights, rewards the
answers that contain the target word (1) over the others (0), turns the rewards into group-relative
advantages and takes one `importance_sampling` step on the sampled tokens, with the sampler's own
logprobs as the behaviour policy. It prints the mean reward per iteration. Optional: RL_BASE_MODEL
(default HuggingFaceTB/SmolLM2-135M-Instruct), RL_ITERATIONS (10), RL_GROUP (16 samples).
"""

from __future__ import annotations

import os
import time
from typing import Any

import tinker
from tinker import types

BASE_MODEL = os.environ.get("RL_BASE_MODEL", "HuggingFaceTB/SmolLM2-135M-Instruct")
ITERATIONS = int(os.environ.get("RL_ITERATIONS", "10"))
GROUP = int(os.environ.get("RL_GROUP", "16"))
QUESTION = "What is the capital of France? Answer in one word."
TARGET = "paris"
LEARNING_RATE = 5e-4
MAX_TOKENS = 8


def prompt_tokens(tokenizer: Any, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def reward(text: str) -> float:
    return 1.0 if TARGET in text.lower() else 0.0


def rl_datum(prompt: list[int], sampled: types.SampledSequence, advantage: float) -> types.Datum:
    """Train on the sampled tokens only: prompt positions get zero advantage (and a dummy logprob)."""
    tokens = prompt + list(sampled.tokens)
    n_prompt = len(prompt) - 1  # positions whose target is still a prompt token
    sampler_logprobs = [float(lp) for lp in (sampled.logprobs or [])]
    if len(sampler_logprobs) != len(sampled.tokens):
        raise RuntimeError("the sampler returned no logprobs for the sampled tokens")
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n_prompt + sampler_logprobs,
            "advantages": [0.0] * n_prompt + [advantage] * len(sampled.tokens),
        },
    )


def main() -> None:
    service = tinker.ServiceClient()  # TINKER_BASE_URL and TINKER_API_KEY from the environment
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompt = prompt_tokens(tokenizer, QUESTION)
    params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)
    started = time.perf_counter()
    for iteration in range(1, ITERATIONS + 1):
        sampler = training.save_weights_and_get_sampling_client().result()  # the current weights
        result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=GROUP, sampling_params=params).result()
        texts = [tokenizer.decode(s.tokens, skip_special_tokens=True) for s in result.sequences]
        rewards = [reward(t) for t in texts]
        mean = sum(rewards) / len(rewards)
        print(f"iteration {iteration:3d}  mean reward {mean:.3f}  e.g. {texts[0].strip()!r}  "
              f"({time.perf_counter() - started:.1f} s)", flush=True)
        data = [rl_datum(prompt, s, r - mean) for s, r in zip(result.sequences, rewards, strict=True)
                if r != mean]  # a zero advantage teaches nothing
        if not data:
            continue  # every answer was rewarded alike: no signal in this group
        backward = training.forward_backward(data, "importance_sampling")
        optim = training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
        backward.result()
        optim.result()
    service.close("success").result()


if __name__ == "__main__":
    main()
