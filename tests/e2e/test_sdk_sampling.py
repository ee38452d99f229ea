"""Sampling through the unmodified `tinker` SDK against `carpool serve` (issue item 1, sampling half).

Named sampler weights → `create_sampling_client(model_path=...)` → `sample`: several greedy samples are
the argmax continuation of the trained adapter (checked against the full next-token distribution the
training side computes), stop strings and stop tokens end a sample where they first occur, temperature 1
draws differ; `compute_logprobs` equals the training side's logprobs; the sampler keeps its snapshot
while the model trains on. `save_weights_and_get_sampling_client` is an ephemeral snapshot too, and a
base-model sampler is the untrained model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.server import Server

VOCAB = 512
TARGETS_PER_POSITION = 64
"""The server's limit on target ids per position of a forward (`loss_fn_inputs` of shape (T, K))."""
TEXT = "the quick brown fox jumps over the lazy dog."
OTHER_TEXT = "a stitch in time saves nine."


@pytest.fixture(scope="module")
def service(server: Server) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.url, api_key=server.create_tenant("sampler"))
    yield client
    client.close("success").result()


def _train(client: tinker.TrainingClient, steps: int, text: str = TEXT) -> None:
    """Steps of next-token training on `text` and the end-of-sequence token (a dozen make the tiny model
    recite it greedily, and stop)."""
    tokenizer = client.get_tokenizer()
    tokens = [*tokenizer.encode(text), tokenizer.eos_token_id]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    for _ in range(steps):
        fb = client.forward_backward([datum], "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=5e-3))
        fb.result()
        opt.result()


def _trained_model(service: tinker.ServiceClient, base_model: str) -> tinker.TrainingClient:
    client = service.create_lora_training_client(base_model=base_model, rank=16, seed=21).result()
    _train(client, 12)
    return client


@pytest.fixture(scope="module")
def trained(service: tinker.ServiceClient, base_model: str) -> tinker.TrainingClient:
    """The module's trained model. Tests only read it (sample, forward): any order sees the same weights."""
    return _trained_model(service, base_model)


@pytest.fixture(scope="module")
def prompt(trained: tinker.TrainingClient) -> list[int]:
    return list(trained.get_tokenizer().encode("the quick"))


def _greedy(sampler: tinker.SamplingClient, prompt: list[int], max_tokens: int = 8, num_samples: int = 1,
            stop: str | list[str] | list[int] | None = None) -> types.SampleResponse:
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)
    return sampler.sample(types.ModelInput.from_ints(prompt), num_samples=num_samples, sampling_params=params).result()


def _training_logprobs(client: tinker.TrainingClient, tokens: Sequence[int]) -> np.ndarray:
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])),
                        loss_fn_inputs={"target_tokens": list(tokens[1:]), "weights": [0.0] * (len(tokens) - 1)})
    return client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def _full_distribution(client: tinker.TrainingClient, tokens: Sequence[int]) -> np.ndarray:
    """log p(v | tokens[:i+1]) for every position i and every vocabulary id v: target_tokens of shape (T, K),
    K ids at a time (the server takes at most TARGETS_PER_POSITION per position)."""
    n = len(tokens) - 1
    datums = []
    for start in range(0, VOCAB, TARGETS_PER_POSITION):
        ids = np.arange(start, min(start + TARGETS_PER_POSITION, VOCAB), dtype=np.int64)
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])), loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.tile(ids, (n, 1))),
            "weights": types.TensorData.from_numpy(np.zeros((n, len(ids)), np.float32))}))
    outputs = client.forward(datums, "cross_entropy").result().loss_fn_outputs
    return np.concatenate([o["logprobs"].to_numpy().reshape(n, -1) for o in outputs], axis=1)


def test_greedy_samples_follow_the_adapters_argmax(service: tinker.ServiceClient, base_model: str,
                                                   prompt: list[int]) -> None:
    trained = _trained_model(service, base_model)  # its own: this test trains on, the shared one stays put
    path = trained.save_weights_for_sampler("greedy").result().path
    assert path == f"tinker://{trained.model_id}/sampler_weights/greedy"
    sampler = service.create_sampling_client(model_path=path).result()
    result = _greedy(sampler, prompt, num_samples=3)
    assert len(result.sequences) == 3
    assert len({s.sequence_id for s in result.sequences}) == 3
    tokens = list(result.sequences[0].tokens)
    assert all(list(s.tokens) == tokens for s in result.sequences)
    assert all(s.stop_reason == "length" for s in result.sequences) and len(tokens) == 8
    tokenizer = trained.get_tokenizer()
    assert tokenizer.decode(tokens).startswith(" brown fox jumps")  # the adapter learned its text

    # Each greedy token is the argmax of the trained model's next-token distribution, with its logprob.
    full = _full_distribution(trained, prompt + tokens)
    generated_rows = full[len(prompt) - 1:]
    assert generated_rows.argmax(axis=1).tolist() == tokens
    logprobs = np.asarray(result.sequences[0].logprobs)
    np.testing.assert_allclose(logprobs, generated_rows[np.arange(len(tokens)), tokens], atol=1e-4)
    assert np.allclose(np.exp(full).sum(axis=1), 1.0, atol=1e-3)  # really the whole vocabulary

    # The sampler is pinned to its snapshot: training on does not change what it samples.
    _train(trained, 3, OTHER_TEXT)
    later = _full_distribution(trained, prompt + tokens)
    assert np.abs(later - full).max() > 1e-2
    again = _greedy(sampler, prompt).sequences[0]
    assert list(again.tokens) == tokens
    np.testing.assert_allclose(np.asarray(again.logprobs), logprobs, atol=1e-6)
    moved = service.create_sampling_client(model_path=trained.save_weights_for_sampler("later").result().path)
    moved_logprobs = np.asarray(_greedy(moved.result(), prompt).sequences[0].logprobs)
    assert np.abs(moved_logprobs - logprobs).max() > 1e-3


def test_stop_strings_and_stop_tokens_end_the_sample(trained: tinker.TrainingClient, prompt: list[int]) -> None:
    sampler = trained.save_weights_and_get_sampling_client().result()
    tokenizer = trained.get_tokenizer()
    full = list(_greedy(sampler, prompt, max_tokens=12).sequences[0].tokens)
    assert len(set(full)) >= 8  # a varied continuation, so where it stops means something

    stop_at = next(i for i in range(3, len(full)) if full[i] not in full[:i])
    by_token = _greedy(sampler, prompt, max_tokens=12, num_samples=2, stop=[full[stop_at]])
    for seq in by_token.sequences:
        assert list(seq.tokens) == full[: stop_at + 1]  # the stop token is included
        assert seq.stop_reason == "stop"

    stop_text = " jumps"
    assert stop_text in tokenizer.decode(full)
    by_string = _greedy(sampler, prompt, max_tokens=12, stop=[stop_text]).sequences[0]
    got = list(by_string.tokens)
    assert by_string.stop_reason == "stop"
    assert got == full[: len(got)] and len(got) < len(full)
    assert stop_text in tokenizer.decode(got) and stop_text not in tokenizer.decode(got[:-1])

    # stop=None (the default) ends at the end-of-sequence token, included; stop=[] disables every stop.
    eos = tokenizer.eos_token_id
    to_the_end = _greedy(sampler, prompt, max_tokens=20).sequences[0]
    assert to_the_end.stop_reason == "stop" and list(to_the_end.tokens)[-1] == eos
    assert tokenizer.decode(list(to_the_end.tokens)[:-1]).endswith("lazy dog.")
    unstopped = _greedy(sampler, prompt, max_tokens=20, stop=[]).sequences[0]
    assert unstopped.stop_reason == "length" and len(unstopped.tokens) == 20
    assert list(unstopped.tokens)[: len(to_the_end.tokens)] == list(to_the_end.tokens)


def test_temperature_one_draws_differ(trained: tinker.TrainingClient, prompt: list[int]) -> None:
    sampler = trained.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=8, temperature=1.0)
    result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=params).result()
    assert len(result.sequences) == 4
    assert len({tuple(s.tokens) for s in result.sequences}) > 1
    assert all(s.logprobs is not None and len(s.logprobs) == len(s.tokens) for s in result.sequences)


def test_compute_logprobs_equals_the_training_side(trained: tinker.TrainingClient) -> None:
    sampler = trained.save_weights_and_get_sampling_client().result()
    sequence = list(trained.get_tokenizer().encode("the lazy dog jumps"))
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(sequence)).result()
    assert len(logprobs) == len(sequence) and logprobs[0] is None
    np.testing.assert_allclose(np.asarray(logprobs[1:], np.float64), _training_logprobs(trained, sequence),
                               atol=1e-4)


def test_ephemeral_sampler_is_a_snapshot_and_base_sampler_is_untrained(
        service: tinker.ServiceClient, base_model: str, prompt: list[int]) -> None:
    model = service.create_lora_training_client(base_model=base_model, rank=4, seed=22).result()
    _train(model, 2)
    sequence = prompt + [5, 88, 401]
    model_input = types.ModelInput.from_ints(sequence)
    snapshot = model.save_weights_and_get_sampling_client().result()
    first = np.asarray(snapshot.compute_logprobs(model_input).result()[1:], np.float64)
    np.testing.assert_allclose(first, _training_logprobs(model, sequence), atol=1e-4)

    _train(model, 2, OTHER_TEXT)
    np.testing.assert_allclose(np.asarray(snapshot.compute_logprobs(model_input).result()[1:], np.float64), first,
                               atol=1e-6)
    now = model.save_weights_and_get_sampling_client().result()
    current = np.asarray(now.compute_logprobs(model_input).result()[1:], np.float64)
    np.testing.assert_allclose(current, _training_logprobs(model, sequence), atol=1e-4)
    assert np.abs(current - first).max() > 1e-3

    base = service.create_sampling_client(base_model=base_model).result()
    assert base.get_base_model() == base_model
    untrained = service.create_lora_training_client(base_model=base_model, rank=4, seed=23).result()
    np.testing.assert_allclose(np.asarray(base.compute_logprobs(model_input).result()[1:], np.float64),
                               _training_logprobs(untrained, sequence), atol=1e-4)
    assert np.abs(current - _training_logprobs(untrained, sequence)).max() > 1e-3
