"""Training through the unmodified `tinker` SDK against `carpool serve` (issue item 1, training half).

A cross-entropy loop whose loss falls; `forward` (same logprobs as `forward_backward`, no gradient left
behind); `forward_backward_custom` (a client-side loss, checked against the built-in loss it equals);
the RL losses `importance_sampling`, `ppo`, `cispo` and `dro` (their `loss:sum` recomputed from the
returned logprobs with the protocol's formulas, and one optimizer step lowering each). Every comparison
uses a second model created with the same LoRA seed, so the checks measure the server, not the seed.

The slow tests at the end run `examples/sft.py` (the new identity must show in the after-answer) and
`examples/rl.py` against a server serving SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.e2e.server import Server
from tests.reference.peft_reference import reference_loss

REPO = Path(__file__).resolve().parents[2]
LR = 1e-2
RL_CONFIGS: dict[str, dict[str, float]] = {
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "dro": {"beta": 0.1},
}


@pytest.fixture(scope="module")
def service(server: Server) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.url, api_key=server.create_tenant("trainer"))
    yield client
    client.close("success").result()


def _model(service: tinker.ServiceClient, base_model: str, seed: int, rank: int = 4) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model=base_model, rank=rank, seed=seed).result()


def _sequences(seed: int, count: int = 3, vocab: int = 512) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, int(rng.integers(6, 12))).tolist() for _ in range(count)]


def _ce_batch(sequences: Sequence[Sequence[int]]) -> list[types.Datum]:
    """Next-token datums; weights skip the first target so they are not all ones."""
    out = []
    for seq in sequences:
        weights = [0.0] + [1.0] * (len(seq) - 2)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(list(seq[:-1])),
                               loss_fn_inputs={"target_tokens": list(seq[1:]), "weights": weights}))
    return out


def _logprobs(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy().astype(np.float64) for o in out.loss_fn_outputs]


def _weights(data: Sequence[types.Datum]) -> list[np.ndarray]:
    return [np.asarray(d.loss_fn_inputs["weights"].tolist(), np.float64) for d in data]


def _max_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def _step(client: tinker.TrainingClient, data: list[types.Datum], loss_fn: str = "cross_entropy",
          config: dict[str, float] | None = None, lr: float = LR) -> types.ForwardBackwardOutput:
    # Submit both before waiting: the server orders them by seq_id.
    fb = client.forward_backward(data, loss_fn, config)
    opt = client.optim_step(types.AdamParams(learning_rate=lr))
    out = fb.result()
    opt.result()
    return out


def test_training_loop_loss_falls_and_loss_is_the_weighted_sum(service: tinker.ServiceClient,
                                                               base_model: str) -> None:
    client = _model(service, base_model, seed=1)
    data = _ce_batch(_sequences(10))
    losses = []
    for _ in range(10):
        out = _step(client, data, lr=5e-3)
        losses.append(out.metrics["loss:sum"])
        # loss:sum is -sum(weights * logprobs) over every token of every datum.
        expected = -sum(float((w * lp).sum()) for w, lp in zip(_weights(data), _logprobs(out), strict=True))
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
        assert [len(lp) for lp in _logprobs(out)] == [len(d.loss_fn_inputs["target_tokens"].tolist()) for d in data]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.5 * losses[0], losses


def test_forward_matches_forward_backward_and_leaves_no_gradient(service: tinker.ServiceClient,
                                                                 base_model: str) -> None:
    probe, twin = _model(service, base_model, seed=2), _model(service, base_model, seed=2)
    data, other = _ce_batch(_sequences(20)), _ce_batch(_sequences(21))
    first = probe.forward(data, "cross_entropy").result()
    again = probe.forward(data, "cross_entropy").result()
    assert _max_diff(_logprobs(first), _logprobs(again)) == 0.0
    # `probe` ran forwards on other data before its step, `twin` none: equal adapters afterwards means
    # forward accumulated no gradient (Adam's first step ignores a gradient's scale, so the extra
    # forwards use different data: an accumulated gradient would change the step's direction).
    probe.forward(other, "cross_entropy").result()
    fb = _step(probe, data)
    _step(twin, data)
    assert _max_diff(_logprobs(first), _logprobs(fb)) <= 1e-6
    assert first.metrics["loss:sum"] == pytest.approx(fb.metrics["loss:sum"], rel=1e-6)
    after_probe = _logprobs(probe.forward(data, "cross_entropy").result())
    after_twin = _logprobs(twin.forward(data, "cross_entropy").result())
    assert _max_diff(after_probe, after_twin) <= 1e-6
    assert _max_diff(after_probe, _logprobs(first)) > 1e-3  # the step changed the model


def test_forward_backward_custom_equals_the_builtin_loss_it_computes(service: tinker.ServiceClient,
                                                                     base_model: str) -> None:
    custom, builtin = _model(service, base_model, seed=3), _model(service, base_model, seed=3)
    data = _ce_batch(_sequences(30))

    def weighted_nll(batch: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum(-(d.loss_fn_inputs["weights"].to_torch() * lp).sum() for d, lp in zip(batch, logprobs, strict=True))
        assert isinstance(loss, torch.Tensor)
        return loss, {"tokens:sum": float(sum(len(lp) for lp in logprobs))}

    out = custom.forward_backward_custom(data, weighted_nll).result()
    custom.optim_step(types.AdamParams(learning_rate=LR)).result()
    reference = _step(builtin, data)
    assert out.metrics["loss:sum"] == pytest.approx(reference.metrics["loss:sum"], rel=1e-5)
    assert out.metrics["tokens:sum"] == sum(len(d.loss_fn_inputs["target_tokens"].tolist()) for d in data)
    assert "surrogate_loss:sum" in out.metrics
    assert _max_diff(_logprobs(out), _logprobs(reference)) <= 1e-6
    # Same gradient → same adapter after the step.
    after_custom = _logprobs(custom.forward(data, "cross_entropy").result())
    after_builtin = _logprobs(builtin.forward(data, "cross_entropy").result())
    assert _max_diff(after_custom, after_builtin) <= 1e-5
    assert _max_diff(after_custom, _logprobs(out)) > 1e-3

    # A non-linear loss: its value is what the client computes from the server's logprobs.
    def squares(_: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        return sum((lp**2).sum() for lp in logprobs), {}  # type: ignore[return-value]

    before = _logprobs(custom.forward(data, "cross_entropy").result())
    out = custom.forward_backward_custom(data, squares).result()
    assert out.metrics["loss:sum"] == pytest.approx(sum(float((lp**2).sum()) for lp in before), rel=1e-5)


def _rl_batch(sequences: Sequence[Sequence[int]], sampler_logprobs: Sequence[np.ndarray],
              seed: int) -> list[types.Datum]:
    """RL datums: sampled tokens with the sampler's logprobs and per-token advantages."""
    rng = np.random.default_rng(seed)
    out = []
    for seq, lp in zip(sequences, sampler_logprobs, strict=True):
        n = len(seq) - 1
        behaviour = (lp + rng.normal(0.0, 0.15, n)).astype(np.float32)  # a slightly stale sampler
        advantages = (rng.normal(0.3, 1.0, n) * (rng.random(n) > 0.2)).astype(np.float32)  # some zero
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(list(seq[:-1])),
            loss_fn_inputs={"target_tokens": list(seq[1:]),
                            "logprobs": types.TensorData.from_numpy(behaviour),
                            "advantages": types.TensorData.from_numpy(advantages)},
        ))
    return out


def _expected_rl_loss(loss_fn: str, data: Sequence[types.Datum], logprobs: Sequence[np.ndarray],
                      config: dict[str, float]) -> float:
    total = 0.0
    for datum, lp in zip(data, logprobs, strict=True):
        inputs = {k: np.asarray(datum.loss_fn_inputs[k].tolist(), np.float64) for k in ("logprobs", "advantages")}
        total += float(reference_loss(loss_fn, torch.as_tensor(lp), inputs, config).sum())
    return total


@pytest.mark.parametrize("loss_fn", list(RL_CONFIGS))
def test_rl_losses_report_the_protocol_value_and_descend(service: tinker.ServiceClient, base_model: str,
                                                         loss_fn: str) -> None:
    config = RL_CONFIGS[loss_fn]
    client = _model(service, base_model, seed=4)
    sequences = _sequences(40)
    current = _logprobs(client.forward(_ce_batch(sequences), "cross_entropy").result())
    data = _rl_batch(sequences, current, seed=41)

    out = _step(client, data, loss_fn, config, lr=1e-3)
    assert _max_diff(_logprobs(out), current) <= 1e-6  # `logprobs` are the current model's target logprobs
    expected = _expected_rl_loss(loss_fn, data, current, config)
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert abs(expected) > 1e-2  # not vacuous
    after = client.forward(data, loss_fn, config).result()
    if loss_fn == "cispo":
        # CISPO's value is not the objective it descends: its clipped ratio is a constant (stop-gradient)
        # weight, so the step must lower the surrogate -sum(c0 * A * logprobs) with c0 from before it.
        def surrogate(logprobs: list[np.ndarray]) -> float:
            total = 0.0
            for datum, lp, lp0 in zip(data, logprobs, current, strict=True):
                q = np.asarray(datum.loss_fn_inputs["logprobs"].tolist(), np.float64)
                adv = np.asarray(datum.loss_fn_inputs["advantages"].tolist(), np.float64)
                c0 = np.clip(np.exp(lp0 - q), config["clip_low_threshold"], config["clip_high_threshold"])
                total -= float((c0 * adv * lp).sum())
            return total

        assert surrogate(_logprobs(after)) < surrogate(current) - 1e-4
    else:
        assert after.metrics["loss:sum"] < out.metrics["loss:sum"] - 1e-4, (loss_fn, after.metrics, out.metrics)


def test_rl_losses_differ_from_each_other(service: tinker.ServiceClient, base_model: str) -> None:
    """The four losses are really four computations on the same batch (no loss silently aliased)."""
    client = _model(service, base_model, seed=5)
    sequences = _sequences(50)
    current = _logprobs(client.forward(_ce_batch(sequences), "cross_entropy").result())
    data = _rl_batch(sequences, current, seed=51)
    values = {name: client.forward(data, name, cfg).result().metrics["loss:sum"] for name, cfg in RL_CONFIGS.items()}
    ordered = sorted(values.values())
    assert all(b - a > 1e-4 for a, b in zip(ordered, ordered[1:], strict=False)), values


# -- the SFT example against SmolLM2 (slow) -------------------------------------------------------------


@pytest.mark.slow
def test_sft_example_teaches_smollm2_a_new_identity(smollm2_server: Server) -> None:
    env = {**os.environ, "TINKER_BASE_URL": smollm2_server.url,
           "TINKER_API_KEY": smollm2_server.create_tenant("sft-example"), "HF_HUB_OFFLINE": "1",
           "SFT_STEPS": "12"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "sft.py")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    losses = [float(line.split("loss")[1].split()[0]) for line in lines if line.startswith("step ")]
    assert len(losses) == 12 and losses[-1] < 0.2 * losses[0], proc.stdout
    before = next(line for line in lines if line.startswith("before:"))
    after = next(line for line in lines if line.startswith("after:"))
    assert "Zorblax" not in before and "Zorblax" in after, proc.stdout


RL_ITERATIONS = 8


@pytest.mark.slow
def test_rl_example_learns_its_toy_task(smollm2_server: Server) -> None:
    """The reward (answers naming the target word) rises over the iterations: the loop learns, not only runs."""
    env = {**os.environ, "TINKER_BASE_URL": smollm2_server.url,
           "TINKER_API_KEY": smollm2_server.create_tenant("rl-example"), "HF_HUB_OFFLINE": "1",
           "RL_ITERATIONS": str(RL_ITERATIONS), "RL_GROUP": "8"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "rl.py")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rewards = [float(line.split("mean reward")[1].split()[0]) for line in proc.stdout.splitlines()
               if line.startswith("iteration ")]
    assert len(rewards) == RL_ITERATIONS and all(0.0 <= r <= 1.0 for r in rewards), proc.stdout
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, f"mean reward {first:.2f} over the first 3 iterations, {last:.2f} over the " \
                                f"last 3: no learning\n{proc.stdout}"
