"""Rendering answers: wire models as JSON, and finished futures in the form the client asked for.

A `Done(kind, result)` from the control plane becomes the result type the SDK expects for that request
kind (protocol §3.3): protobuf `ForwardBackwardOutput` / `SampleResponse` when the poll's `Accept` asks
for `application/x-protobuf` (SDK >= 0.18), their legacy JSON form otherwise, and JSON models for every
other kind. A result that does not fit its kind is a server bug: it is logged and answered as a failed
future (category `server`) instead of an HTTP 500 the SDK would re-poll forever.

`SampleRenderCache` remembers, per `asample` request id, the two request options that shape the
rendered result but are not part of the domain result (`topk_prompt_logprobs`, `prompt_logprobs_last_n`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from services.control.api import (
    CheckpointRef,
    Done,
    Failed,
    ModelCreated,
    OptimStepDone,
    SamplerRef,
    WeightsLoaded,
)
from services.control.surface_views import CustomLossCreated
from services.domain.sampling import SampleResult
from services.domain.training import ForwardBackwardResult, OptimStepResult
from services.wire import (
    CONTENT_TYPE_PROTOBUF,
    ForwardBackwardOutput,
    SampleResponse,
    encode_forward_backward_output,
    encode_sample_response,
    forward_backward_output,
    optim_step_response,
    sample_response,
)
from services.wire.responses import (
    CreateCustomLossResponse,
    CreateModelResponse,
    LoadWeightsResponse,
    RequestFailedResponse,
    SaveWeightsExternalResponseInternal,
    SaveWeightsForSamplerResponseInternal,
    SaveWeightsResponse,
    UnloadModelResponse,
)

log = logging.getLogger(__name__)

ResultPayload = BaseModel | ForwardBackwardOutput | SampleResponse


def wire_json(model: BaseModel, status_code: int = 200) -> JSONResponse:
    """A wire model as JSON; `None` fields are left out (all optional for the SDK)."""
    return JSONResponse(model.model_dump(mode="json", exclude_none=True), status_code=status_code)


def wants_protobuf(accept: str | None) -> bool:
    return bool(accept) and CONTENT_TYPE_PROTOBUF in (accept or "").lower()


@dataclass(frozen=True)
class SampleRenderOptions:
    """Request options of an `asample` needed to render its result."""

    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None


DEFAULT_SAMPLE_RENDER = SampleRenderOptions()


class SampleRenderCache:
    """Bounded LRU of `SampleRenderOptions` by request id; defaults take no slot.

    In-process: a poll that reaches another gateway replica renders with the defaults (top-k rows padded
    to their widest row, no `prompt_logprobs_last_n` blanking).
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str, SampleRenderOptions] = OrderedDict()

    def remember(self, request_id: str, options: SampleRenderOptions) -> None:
        if options == DEFAULT_SAMPLE_RENDER or self._capacity <= 0:
            return
        self._entries[request_id] = options
        self._entries.move_to_end(request_id)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def get(self, request_id: str) -> SampleRenderOptions:
        return self._entries.get(request_id, DEFAULT_SAMPLE_RENDER)


class ResultMismatch(Exception):
    """A finished future whose result type does not fit its request kind (a server-side bug)."""


def result_payload(done: Done, options: SampleRenderOptions = DEFAULT_SAMPLE_RENDER) -> ResultPayload:
    """The wire result of a finished future; raises `ResultMismatch` when kind and result disagree."""
    result = done.result
    if done.kind in ("forward", "forward_backward") and isinstance(result, ForwardBackwardResult):
        return forward_backward_output(result)
    if done.kind == "sample" and isinstance(result, SampleResult):
        return sample_response(
            result,
            topk_prompt_logprobs=options.topk_prompt_logprobs,
            prompt_logprobs_last_n=options.prompt_logprobs_last_n,
        )
    if done.kind == "optim_step" and isinstance(result, OptimStepDone):
        return optim_step_response(OptimStepResult(metrics=result.metrics))
    payload = _model_payload(done.kind, result)
    if payload is None:
        raise ResultMismatch(f"{done.kind} finished with a {type(result).__name__}")
    return payload


_MODEL_ANSWERS: dict[str, type[CreateModelResponse | LoadWeightsResponse | UnloadModelResponse]] = {
    "create_model": CreateModelResponse,
    "load_weights": LoadWeightsResponse,
    "unload_model": UnloadModelResponse,
}


def _model_payload(kind: str, result: object) -> BaseModel | None:
    """JSON results of the model-lifecycle and checkpoint kinds."""
    if isinstance(result, ModelCreated):
        model_answer = _MODEL_ANSWERS.get(kind)
        return None if model_answer is None else model_answer(model_id=result.model_id)
    if isinstance(result, WeightsLoaded) and kind == "load_weights":
        return LoadWeightsResponse(path=result.tinker_path, model_id=result.model_id)
    if isinstance(result, SamplerRef) and kind == "save_weights_for_sampler":
        return SaveWeightsForSamplerResponseInternal(sampling_session_id=result.sampling_session_id)
    if isinstance(result, CheckpointRef):
        return _checkpoint_payload(kind, result)
    if isinstance(result, CustomLossCreated) and kind == "create_custom_loss":
        return CreateCustomLossResponse(loss_id=result.loss_id)
    return None


def _checkpoint_payload(kind: str, ref: CheckpointRef) -> BaseModel | None:
    if kind == "save_weights":
        return SaveWeightsResponse(path=ref.tinker_path)
    if kind == "save_weights_for_sampler":
        return SaveWeightsForSamplerResponseInternal(path=ref.tinker_path)
    if kind == "save_weights_external":
        return SaveWeightsExternalResponseInternal(path=ref.tinker_path, size_bytes=ref.size_bytes)
    if kind == "load_weights":
        return LoadWeightsResponse(path=ref.tinker_path)
    return None


def failed_payload(failed: Failed) -> RequestFailedResponse:
    return RequestFailedResponse(error=failed.error, category=failed.category)


def safe_result_payload(
    request_id: str, done: Done, options: SampleRenderOptions
) -> ResultPayload | RequestFailedResponse:
    """`result_payload`, with a rendering failure turned into a failed future (and logged)."""
    try:
        return result_payload(done, options)
    except (ResultMismatch, ValueError):
        log.exception("cannot render the result of %s (%s)", request_id, done.kind)
        return RequestFailedResponse(error="the server produced an invalid result", category="server")


def tinker_result_response(payload: ResultPayload | RequestFailedResponse, *, protobuf: bool) -> Response:
    """The `retrieve_future` answer of a finished future (HTTP 200 in every case, protocol §3.2)."""
    if isinstance(payload, ForwardBackwardOutput):
        if protobuf:
            return Response(encode_forward_backward_output(payload), media_type=CONTENT_TYPE_PROTOBUF)
        return JSONResponse(payload.to_json_dict())
    if isinstance(payload, SampleResponse):
        if protobuf:
            return Response(encode_sample_response(payload), media_type=CONTENT_TYPE_PROTOBUF)
        return JSONResponse(payload.to_json_dict())
    return wire_json(payload)


def payload_json(payload: ResultPayload | RequestFailedResponse) -> dict[str, Any]:
    """Any result as a JSON object (REST clients always get JSON)."""
    if isinstance(payload, (ForwardBackwardOutput, SampleResponse)):
        return payload.to_json_dict()
    return payload.model_dump(mode="json", exclude_none=True)
