"""Server-side custom losses: the SDK's traced graph is checked against the allow-list and limits, then
interpreted; the result equals running the traced function itself (values, metrics, gradients).

Graphs come from the installed SDK's own tracer and encoder (`trace_loss`, `encode_graph`), so a change in
the wire format of a new SDK shows up here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from services.domain.custom_loss import MAX_ARG_DEPTH, MAX_NODES, InvalidCustomLoss, build_program
from worker.engine.custom_loss import CustomLossError, run_custom_loss


def ppo_like(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
             advantages: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = torch.exp(logprobs - sampler_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    kl = (sampler_logprobs - logprobs).mean()
    return loss + 0.01 * torch.nn.functional.softplus(logprobs).sum(), {"custom/kl:mean": kl,
                                                                         "custom/loss:sum": loss}


def topk_distill(logprobs: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    probs = torch.softmax(logprobs, dim=-1)
    loss = -(weights * logprobs).sum() + (probs[..., 0:1] * 0.5).sum()
    return loss, {"custom/first:sum": probs[..., 0].sum()}


def _program(fn: Any, ranks: dict[str, int]) -> tuple[Any, Any]:
    handle = trace_loss(fn, ranks, "sess")
    graph = encode_graph(handle)
    doc = json.loads(json.dumps([n.model_dump() for n in graph.nodes]))  # exactly what crosses the wire
    inputs = [{"name": i.name, "rank": i.rank} for i in handle.inputs]
    return build_program("loss-1", handle.name, inputs, doc), handle


@pytest.mark.parametrize(("fn", "ranks", "shape"), [
    (ppo_like, {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1}, (7,)),
    (topk_distill, {"logprobs": 2, "weights": 2}, (5, 3)),
])
def test_interpreted_graph_equals_the_traced_function(fn: Any, ranks: dict[str, int], shape: tuple[int, ...]) -> None:
    program, handle = _program(fn, ranks)
    gen = torch.Generator().manual_seed(0)
    inputs = {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name in program.input_names}
    lp_a = torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
    lp_b = lp_a.detach().clone().requires_grad_()

    loss, metrics = run_custom_loss(program, lp_a, inputs)
    expected, expected_metrics = handle.graph(lp_b, *(inputs[n] for n in program.input_names))
    loss.backward()
    expected.backward()
    assert lp_a.grad is not None and lp_b.grad is not None
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=0, atol=0)
    assert metrics.keys() == expected_metrics.keys()
    for key, value in metrics.items():
        torch.testing.assert_close(value, expected_metrics[key])


def _graph(*nodes: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}}, *nodes,
            {"op": "output", "name": "output", "target": "output",
             "args": [{"tuple": [{"ref": nodes[-1]["name"] if nodes else "logprobs"}, {"dict": {}}]}], "kwargs": {}}]


def _call(name: str, target: str, *args: Any, op: str = "call_function") -> dict[str, Any]:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": {}}


INPUTS = [{"name": "logprobs", "rank": 1}]


@pytest.mark.parametrize(("node", "reason"), [
    (_call("x", "builtins.eval", "1"), "operation 'builtins.eval' is not allowed"),
    (_call("x", "os.system", "ls"), "operation 'os.system' is not allowed"),
    (_call("x", "torch.load", "f"), "operation 'torch.load' is not allowed"),
    (_call("x", "__reduce__", {"ref": "logprobs"}, op="call_method"), "tensor method '__reduce__' is not allowed"),
    (_call("x", "expand", {"ref": "logprobs"}, 10**6, op="call_method"), "tensor method 'expand' is not allowed"),
    (_call("x", "linear", {"ref": "logprobs"}, op="call_module"), "node kind 'call_module' is not allowed"),
    (_call("x", "weights", op="get_attr"), "node kind 'get_attr' is not allowed"),
    (_call("x", "torch.exp", {"ref": "later"}), "refers to 'later' before it is defined"),
    (_call("x", "torch.exp", {"dtype": "complex128"}), "is not allowed"),
    (_call("x", "torch.full_like", {"ref": "logprobs"}, 2**40), "out of range"),
])
def test_graph_outside_the_allow_list_is_refused_naming_the_reason(node: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidCustomLoss) as err:
        build_program("l", "bad", INPUTS, _graph(node))
    assert reason in err.value.message
    assert "(x)" in err.value.field or err.value.field.startswith("graph")


def test_oversized_graphs_are_refused() -> None:
    chain = [_call(f"n{i}", "torch.exp", {"ref": f"n{i - 1}" if i else "logprobs"}) for i in range(MAX_NODES)]
    with pytest.raises(InvalidCustomLoss, match=f"exceed the limit of {MAX_NODES}"):
        build_program("l", "long", INPUTS, _graph(*chain))
    deep: Any = 1.0
    for _ in range(MAX_ARG_DEPTH + 2):
        deep = {"tuple": [deep]}
    with pytest.raises(InvalidCustomLoss, match="nest deeper"):
        build_program("l", "deep", INPUTS, _graph(_call("x", "torch.exp", deep)))
    wide = _call("x", "torch.stack", [{"ref": "logprobs"}] * 40)
    with pytest.raises(InvalidCustomLoss, match="the limit is"):
        build_program("l", "wide", INPUTS, _graph(wide))


def test_inputs_must_match_the_placeholders_and_start_with_logprobs() -> None:
    with pytest.raises(InvalidCustomLoss, match="logprobs"):
        build_program("l", "x", [{"name": "weights", "rank": 1}], _graph())
    with pytest.raises(InvalidCustomLoss, match="placeholders"):
        build_program("l", "x", [*INPUTS, {"name": "weights", "rank": 1}], _graph())


def test_a_non_scalar_loss_fails_the_datum_not_the_process() -> None:
    program = build_program("l", "vector", INPUTS, _graph(_call("x", "torch.exp", {"ref": "logprobs"})))
    with pytest.raises(CustomLossError, match="scalar"):
        run_custom_loss(program, torch.zeros(4), {})


def test_programs_and_stability_spans_cross_redis_through_the_codec() -> None:
    """Cluster mode queues the work with the msgpack codec: a program and loss spans survive it unchanged."""
    import numpy as np

    from services.control.surface_views import CustomLossCreated
    from services.control.weights_copy import DropAdapter
    from services.db.ids import ModelId
    from services.domain.training import AdapterId, Datum, ForwardBackwardWork, SampledSpan
    from services.jobqueue.codec import decode, encode

    program, _ = _program(ppo_like, {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1})
    datum = Datum(np.arange(4), {"target_tokens": np.arange(1, 5)}, loss_spans=(SampledSpan("req-1:0", 0, 4),))
    work = ForwardBackwardWork(AdapterId("a"), [datum], "custom", custom_loss_id="loss-1", custom_loss=program)
    back = decode(encode(work), ForwardBackwardWork)
    assert back.custom_loss == program and back.data[0].loss_spans == datum.loss_spans
    assert decode(encode(CustomLossCreated("loss-1")), CustomLossCreated) == CustomLossCreated("loss-1")
    drop = DropAdapter(ModelId("m"), AdapterId("m"))
    assert decode(encode(drop), DropAdapter) == drop


@pytest.mark.parametrize(("nodes", "reason"), [
    # [0.0] * 2**31: Python arithmetic on constants would allocate gigabytes.
    ([_call("x", "operator.mul", [0.0], 2**31)], "needs a tensor operand"),
    ([_call("x", "operator.pow", 2, 2**31)], "needs a tensor operand"),
    # x[:, None] * x[None, :] on a long input: the broadcast is refused before it allocates.
    ([_call("a", "unsqueeze", {"ref": "logprobs"}, 1, op="call_method"),
      _call("b", "unsqueeze", {"ref": "logprobs"}, 0, op="call_method"),
      _call("x", "operator.mul", {"ref": "a"}, {"ref": "b"})], "would make"),
    ([_call("x", "math.exp", 1e6)], "failed"),
])
def test_runaway_computations_fail_the_datum_before_they_run(nodes: list[dict[str, Any]], reason: str) -> None:
    program = build_program("l", "runaway", INPUTS, _graph(*nodes))
    with pytest.raises(CustomLossError, match=reason):
        run_custom_loss(program, torch.zeros(8192), {})


def test_a_failing_custom_loss_fails_its_request_only(tiny_model_dir: Any) -> None:
    """`logprobs[5]` fails on the short datum: the whole request fails and leaves its adapter's gradient
    untouched, while another tenant in the same pass gets exactly its solo result."""
    import numpy as np

    from services.domain.training import (
        AdamParams,
        AdapterId,
        Datum,
        ForwardBackwardResult,
        ForwardBackwardWork,
        LoraSpec,
        WorkError,
    )
    from worker.engine.engine import Engine, EngineConfig

    program = build_program("l", "fifth", INPUTS, _graph(_call("x", "operator.getitem", {"ref": "logprobs"}, 5)))
    config = EngineConfig(device="cpu", dtype="float32", lora_strategy="loop")
    packed, solo = Engine(tiny_model_dir, name="t", config=config), Engine(tiny_model_dir, name="t", config=config)
    for engine in (packed, solo):
        engine.create_adapter(AdapterId("other"), LoraSpec(rank=4, seed=1))
    packed.create_adapter(AdapterId("custom"), LoraSpec(rank=4, seed=2))

    def datum(n: int) -> Datum:
        seq = np.arange(3, 4 + n)
        return Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(n, np.float32)})

    other = ForwardBackwardWork(AdapterId("other"), [datum(7)])
    custom = ForwardBackwardWork(AdapterId("custom"), [datum(9), datum(3)], "custom", custom_loss=program)
    before = {k: v.detach().clone() for k, v in packed.adapter(AdapterId("custom")).params.items()}
    failed, together = packed.forward_backward([custom, other])
    alone = solo.forward_backward([other])[0]
    assert isinstance(failed, WorkError) and "index 5" in failed.message
    assert isinstance(together, ForwardBackwardResult) and isinstance(alone, ForwardBackwardResult)
    assert together.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-6)
    packed.optim_step(AdapterId("custom"), AdamParams(learning_rate=1.0))
    for key, value in packed.adapter(AdapterId("custom")).params.items():
        assert torch.equal(value.detach(), before[key]), key
