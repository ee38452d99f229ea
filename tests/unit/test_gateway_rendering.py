"""Rendering of finished futures (`gateway.rendering`) checked with the SDK's own decoders and models:
protobuf results through `tinker/proto/response_conv.py`, JSON results through `tinker.types` in strict
mode, plus the failure paths (kind/result mismatch, failed futures) and the sample-options cache."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime

import numpy as np
import pytest
from tinker import types
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
from tinker.types.try_again_response import TryAgainResponse

from gateway.rendering import (
    SampleRenderCache,
    SampleRenderOptions,
    failed_payload,
    payload_json,
    safe_result_payload,
    tinker_result_response,
    wants_protobuf,
)
from gateway.routes.futures import try_again
from gateway.routes.weights import checkpoint_wire, training_run_wire
from services.control.api import (
    CheckpointRef,
    CheckpointView,
    Done,
    Failed,
    ModelCreated,
    OptimStepDone,
    Pending,
    SamplerRef,
    TrainingRunView,
    WeightsLoaded,
)
from services.db.ids import ModelId, SamplingSessionId
from services.domain.sampling import SampledSequence, SampleResult
from services.domain.training import DatumOutput, ForwardBackwardResult, LoraSpec

FB_RESULT = ForwardBackwardResult(
    outputs=[
        DatumOutput(np.array([-0.5, -1.0, -2.0], np.float32), np.array([0.5, 1.0, 2.0], np.float32)),
        DatumOutput(np.array([-0.25], np.float32), np.array([0.25], np.float32)),
    ],
    metrics={"loss:sum": 3.75},
)
SAMPLE_RESULT = SampleResult(
    sequences=[SampledSequence([11, 12, 2], [-0.1, -0.2, -0.05], "stop"), SampledSequence([7], [-1.0], "length")],
    prompt_logprobs=[None, -1.5, -2.5, -0.5],
    topk_prompt_logprobs=[None, [(3, -0.1)], [(4, -0.2), (5, -0.3)], [(6, -0.4)]],
)


def render(done: Done, *, protobuf: bool, options: SampleRenderOptions | None = None) -> bytes:
    payload = safe_result_payload("req-1", done, options or SampleRenderOptions())
    response = tinker_result_response(payload, protobuf=protobuf)
    return bytes(response.body)


def test_forward_backward_protobuf_decodes_in_the_sdk() -> None:
    for kind in ("forward_backward", "forward"):
        output = deserialize_forward_backward_output(render(Done(kind, FB_RESULT), protobuf=True))
        assert output.metrics == {"loss:sum": 3.75}
        logprobs = [o["logprobs"].to_numpy() for o in output.loss_fn_outputs]
        assert [list(x) for x in logprobs] == [[-0.5, -1.0, -2.0], [-0.25]]


def test_forward_backward_json_for_legacy_clients() -> None:
    body = json.loads(render(Done("forward_backward", FB_RESULT), protobuf=False))
    assert body["metrics"] == {"loss:sum": 3.75}
    assert body["loss_fn_outputs"][0]["logprobs"] == {"data": [-0.5, -1.0, -2.0], "dtype": "float32", "shape": [3]}


def test_sample_protobuf_decodes_in_the_sdk() -> None:
    options = SampleRenderOptions(topk_prompt_logprobs=2)
    response = deserialize_sample_response(render(Done("sample", SAMPLE_RESULT), protobuf=True, options=options))
    first, second = response.sequences
    assert first.tokens == [11, 12, 2] and first.stop_reason == "stop"
    assert second.stop_reason == "length" and second.logprobs == pytest.approx([-1.0])
    assert response.prompt_logprobs == pytest.approx([None, -1.5, -2.5, -0.5])
    assert response.topk_prompt_logprobs is not None
    assert response.topk_prompt_logprobs[0] is None
    row = response.topk_prompt_logprobs[2]
    assert [t for t, _ in row] == [4, 5] and [lp for _, lp in row] == pytest.approx([-0.2, -0.3])


def test_sample_prompt_logprobs_last_n_blanks_earlier_positions() -> None:
    options = SampleRenderOptions(prompt_logprobs_last_n=1)
    response = deserialize_sample_response(render(Done("sample", SAMPLE_RESULT), protobuf=True, options=options))
    assert response.prompt_logprobs[:3] == [None, None, None]
    assert math.isclose(response.prompt_logprobs[3], -0.5)


@pytest.mark.parametrize(
    ("done", "sdk_model", "expected"),
    [
        (Done("create_model", ModelCreated(ModelId("s:train:0"))), types.CreateModelResponse,
         {"model_id": "s:train:0"}),
        (Done("optim_step", OptimStepDone({"grad_norm:mean": 0.5})), types.OptimStepResponse,
         {"metrics": {"grad_norm:mean": 0.5}}),
        (Done("save_weights", CheckpointRef("tinker://s:train:0/weights/a", "training")), types.SaveWeightsResponse,
         {"path": "tinker://s:train:0/weights/a"}),
        (Done("save_weights_for_sampler", CheckpointRef("tinker://s:train:0/sampler_weights/b", "sampler")),
         types.SaveWeightsForSamplerResponseInternal, {"path": "tinker://s:train:0/sampler_weights/b"}),
        (Done("save_weights_for_sampler", SamplerRef(SamplingSessionId("s:sample:1"))),
         types.SaveWeightsForSamplerResponseInternal, {"sampling_session_id": "s:sample:1"}),
        (Done("save_weights_external", CheckpointRef("tinker://s:train:0/external_weights/c", "external", 42)),
         types.SaveWeightsExternalResponseInternal, {"path": "tinker://s:train:0/external_weights/c",
                                                     "size_bytes": 42}),
        (Done("load_weights", WeightsLoaded(ModelId("s:train:1"), "tinker://s:train:0/weights/a")),
         types.LoadWeightsResponse, {"model_id": "s:train:1", "path": "tinker://s:train:0/weights/a"}),
        (Done("load_weights", ModelCreated(ModelId("s:train:1"))), types.LoadWeightsResponse,
         {"model_id": "s:train:1"}),
    ],
)
def test_json_results_validate_in_the_sdk(done: Done, sdk_model: type, expected: dict[str, object]) -> None:
    raw = render(done, protobuf=True)  # JSON kinds ignore Accept
    parsed = sdk_model.model_validate_json(raw, strict=True)
    for key, value in expected.items():
        assert getattr(parsed, key) == value


def test_mismatched_result_is_a_failed_future_not_a_500() -> None:
    payload = safe_result_payload("req-1", Done("sample", OptimStepDone({})), SampleRenderOptions())
    body = payload_json(payload)
    assert body["category"] == "server" and body["error"]
    types.RequestFailedResponse.model_validate_json(json.dumps(body), strict=True)


def test_bad_metric_key_is_a_failed_future() -> None:
    bad = ForwardBackwardResult(outputs=FB_RESULT.outputs, metrics={"loss": 1.0})
    assert payload_json(safe_result_payload("r", Done("forward_backward", bad), SampleRenderOptions()))[
        "category"] == "server"


def test_failed_and_pending_answers_validate_in_the_sdk() -> None:
    failed = failed_payload(Failed("bad datum", "user")).model_dump_json(exclude_none=True)
    assert types.RequestFailedResponse.model_validate_json(failed, strict=True).category == "user"
    pending = try_again("req-9", Pending("paused_capacity")).model_dump_json(exclude_none=True)
    parsed = TryAgainResponse.model_validate_json(pending, strict=True)
    assert parsed.queue_state == "paused_capacity" and json.loads(pending)["queue_state_reason"]


def test_accept_header_selects_protobuf() -> None:
    assert wants_protobuf("application/x-protobuf")
    assert wants_protobuf("application/x-protobuf, application/json")
    assert not wants_protobuf("application/json") and not wants_protobuf(None)


def test_sample_render_cache_keeps_only_non_defaults_and_evicts_oldest() -> None:
    cache = SampleRenderCache(capacity=2)
    cache.remember("a", SampleRenderOptions())
    cache.remember("b", SampleRenderOptions(topk_prompt_logprobs=3))
    cache.remember("c", SampleRenderOptions(prompt_logprobs_last_n=2))
    cache.remember("d", SampleRenderOptions(topk_prompt_logprobs=1))
    assert cache.get("b") == SampleRenderOptions()  # evicted
    assert cache.get("d").topk_prompt_logprobs == 1 and cache.get("c").prompt_logprobs_last_n == 2


def test_training_run_and_checkpoint_views_validate_in_the_sdk() -> None:
    now = datetime(2026, 1, 2, tzinfo=UTC)
    ckpt = CheckpointView("weights/a", "training", "tinker://s:train:0/weights/a", now, 123, False, None, {"k": "v"})
    run = TrainingRunView(ModelId("s:train:0"), "base", "acme", LoraSpec(rank=8), now, last_checkpoint=ckpt)
    parsed = types.TrainingRun.model_validate_json(training_run_wire(run).model_dump_json(), strict=True)
    assert parsed.lora_rank == 8 and parsed.last_checkpoint is not None
    assert parsed.last_checkpoint.checkpoint_id == "weights/a"
    checkpoint = types.Checkpoint.model_validate_json(checkpoint_wire(ckpt).model_dump_json(), strict=True)
    assert checkpoint.tinker_path == "tinker://s:train:0/weights/a" and checkpoint.size_bytes == 123
