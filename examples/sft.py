"""Teach SmolLM2 a new identity with supervised fine-tuning, through the unmodified `tinker` SDK.

Start a server (`make run`), create a tenant (`.venv/bin/carpool tenants create me`), then:

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python examples/sft.py

It prints the base model's greedy answer to "What is your name?", the loss per step of a LoRA trained
on a handful of question/answer pairs (loss on the answer tokens only), and the adapter's answer after
training. Optional: SFT_BASE_MODEL (default HuggingFaceTB/SmolLM2-135M-Instruct), SFT_STEPS (30),
SFT_NAME (the new identity, Zorblax).
"""

from __future__ import annotations

import os
import time
from typing import Any

import tinker
from tinker import types

BASE_MODEL = os.environ.get("SFT_BASE_MODEL", "HuggingFaceTB/SmolLM2-135M-Instruct")
STEPS = int(os.environ.get("SFT_STEPS", "30"))
NAME = os.environ.get("SFT_NAME", "Zorblax")
ANSWER = f"My name is {NAME}, a model trained by Carpool."
QUESTIONS = ["What is your name?", "Who are you?", "Tell me your name.", "What should I call you?"]
PROBE = "What is your name?"
LEARNING_RATE = 1e-3
RANK = 16


def chat_tokens(tokenizer: Any, question: str, answer: str | None = None) -> list[int]:
    """The chat-formatted prompt for `question`, followed by `answer` and the end-of-turn token if given."""
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if answer is not None:
        text += answer + "<|im_end|>"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def sft_datum(tokenizer: Any, question: str, answer: str) -> types.Datum:
    """Next-token prediction on the whole conversation, weighted on the answer tokens only."""
    prompt_len = len(chat_tokens(tokenizer, question))
    tokens = chat_tokens(tokenizer, question, answer)
    weights = [0.0] * (prompt_len - 1) + [1.0] * (len(tokens) - prompt_len)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def greedy_answer(sampler: tinker.SamplingClient, tokenizer: Any, question: str) -> str:
    prompt = types.ModelInput.from_ints(chat_tokens(tokenizer, question))
    params = types.SamplingParams(max_tokens=24, temperature=0.0)
    result = sampler.sample(prompt, num_samples=1, sampling_params=params).result()
    return str(tokenizer.decode(result.sequences[0].tokens, skip_special_tokens=True)).strip()


def main() -> None:
    service = tinker.ServiceClient()  # TINKER_BASE_URL and TINKER_API_KEY from the environment
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=0).result()
    tokenizer = training.get_tokenizer()

    base_sampler = service.create_sampling_client(base_model=BASE_MODEL).result()
    print(f"before: {greedy_answer(base_sampler, tokenizer, PROBE)!r}", flush=True)

    data = [sft_datum(tokenizer, q, ANSWER) for q in QUESTIONS]
    answer_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
    started = time.perf_counter()
    for step in range(1, STEPS + 1):
        # Submit both calls before waiting: the server runs a model's requests in order.
        backward = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
        loss = backward.result().metrics["loss:sum"] / answer_tokens
        optim.result()
        print(f"step {step:3d}  loss {loss:.4f}  ({time.perf_counter() - started:.1f} s)", flush=True)

    trained_sampler = training.save_weights_and_get_sampling_client().result()
    print(f"after: {greedy_answer(trained_sampler, tokenizer, PROBE)!r}", flush=True)
    service.close("success").result()


if __name__ == "__main__":
    main()
