"""Training-run endpoints of the Tinker API: create_model, get_info, forward_backward (protobuf, optionally
zstd, and legacy JSON), legacy `/api/v1/forward`, optim_step, unload_model.

Submissions answer an `UntypedAPIFuture` at once; results come from `retrieve_future`. Every request
that carries a `seq_id` runs inside a `SeqIdGuard`, so one rejected here (bad body, unknown loss,
invalid data) still consumes its seq_id and the model's later requests are not blocked (§6.1).
The work item's `adapter_id` is the model id; the control plane resolves it to the resident adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.deps import Control, CurrentTenant, RawBody, SettingsDep, documents_body, parse_body
from gateway.errors import SeqIdGuard
from gateway.rendering import wire_json
from gateway.settings import GatewaySettings
from services.auth.tenants import Tenant
from services.control.api import ControlPlane
from services.db.ids import ModelId, SessionId
from services.domain.training import AdapterId, ForwardBackwardWork
from services.domain.validation import InvalidWork
from services.wire import (
    CONTENT_TYPE_PROTOBUF,
    ForwardBackwardCall,
    WireError,
    adam_params,
    check_optimizer_config,
    forward_backward_work,
    get_info_response,
    lora_spec,
)
from services.wire.arrays import TensorLimits
from services.wire.convert import ParsedForwardBackward, parse_forward_backward_body
from services.wire.requests import (
    CreateModelRequest,
    ForwardBackwardRequest,
    ForwardRequest,
    GetInfoRequest,
    OptimStepRequest,
    UnloadModelRequest,
)
from services.wire.responses import GetInfoResponse, UntypedAPIFuture

router = APIRouter(prefix="/api/v1", tags=["training"])

@router.post("/create_model", response_model=UntypedAPIFuture)
@documents_body(CreateModelRequest)
async def create_model(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """Create LoRA training run `{session_id}:train:{model_seq_id}` (result: `CreateModelResponse`)."""
    request = parse_body(CreateModelRequest, body)
    check_optimizer_config(request.optimizer_config)
    submitted = await control.create_model(
        tenant, SessionId(request.session_id), request.model_seq_id, request.base_model,
        lora_spec(request.lora_config), request.user_metadata,
    )
    return wire_json(UntypedAPIFuture(request_id=submitted.request_id, model_id=submitted.model_id))


@router.post("/get_info", response_model=GetInfoResponse)
@documents_body(GetInfoRequest)
async def get_info(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """Model metadata; `model_data.tokenizer_id` is a tokenizer directory loadable offline."""
    request = parse_body(GetInfoRequest, body)
    return await model_info_response(tenant, control, request.model_id)


async def model_info_response(tenant: CurrentTenant, control: Control, model_id: str) -> JSONResponse:
    info = await control.get_info(tenant, ModelId(model_id))
    return wire_json(get_info_response(info.model_id, info.base, info.lora))


@router.post("/forward_backward", response_model=UntypedAPIFuture)
@documents_body((CONTENT_TYPE_PROTOBUF, None), ForwardBackwardRequest)
async def forward_backward(
    request: Request, tenant: CurrentTenant, control: Control, settings: SettingsDep, body: RawBody
) -> JSONResponse:
    """Forward + backward (or forward only): a protobuf `ForwardBackwardRequest` (SDK >= 0.25, optionally
    `Content-Encoding: zstd`) or the legacy JSON body; result: `ForwardBackwardOutput`."""
    return await _submit_forward_backward(request, tenant, control, settings, body, legacy_forward=False)


@router.post("/forward", response_model=UntypedAPIFuture)
@documents_body(ForwardRequest)
async def forward(
    request: Request, tenant: CurrentTenant, control: Control, settings: SettingsDep, body: RawBody
) -> JSONResponse:
    """Legacy forward-only pass (JSON `ForwardRequest`, SDK <= 0.24); result: `ForwardBackwardOutput`."""
    return await _submit_forward_backward(request, tenant, control, settings, body, legacy_forward=True)


async def _submit_forward_backward(
    request: Request, tenant: CurrentTenant, control: Control, settings: GatewaySettings, body: bytes,
    *, legacy_forward: bool,
) -> JSONResponse:
    """Parse, check the model is the caller's, only then densify: a foreign or unknown model id gets its
    404 before any tensor is allocated. Both steps run on the gateway's bounded decode pool."""
    pool = request.app.state.decode_pool
    limits = TensorLimits(max_tensor_elements=settings.max_loss_input_elements,
                          max_request_elements=settings.max_loss_input_elements, max_target_k=settings.max_target_k)
    parse = partial(parse_forward_backward_body, body, request.headers.get("content-type"),
                    request.headers.get("content-encoding"), legacy_forward=legacy_forward,
                    max_body_bytes=settings.max_body_bytes, limits=limits)
    async with SeqIdGuard(control, tenant) as guard:
        parsed, densified = await pool.run(partial(_parse_then_densify_if_owned, parse, control, tenant))
        guard.track(parsed.model_id, parsed.seq_id)
        if densified is None:
            if parsed.model_id:
                await control.get_info(tenant, ModelId(parsed.model_id))  # ownership: 404 for unknown and foreign
            densified = await pool.run(partial(_densify_or_error, parsed))
        if isinstance(densified, (WireError, InvalidWork)):
            raise densified  # after track(): the guard consumes the tracked seq id
        call, work = densified
        assert call.seq_id is not None  # checked by _densify
        submitted = await control.forward_backward(tenant, ModelId(call.model_id), call.seq_id, work)
    return wire_json(UntypedAPIFuture(request_id=submitted.request_id, model_id=call.model_id))


_Densified = tuple[ForwardBackwardCall, ForwardBackwardWork] | WireError | InvalidWork


def _parse_then_densify_if_owned(
    parse: Callable[[], ParsedForwardBackward], control: ControlPlane, tenant: Tenant
) -> tuple[ParsedForwardBackward, _Densified | None]:
    """One decode-pool job for a training loop's usual step: parse, and densify at once when the model is
    already known to be the caller's (`model_known_owned`, memory only); otherwise None, and the route looks
    ownership up before it densifies."""
    parsed = parse()
    if not parsed.model_id or not control.model_known_owned(tenant, ModelId(parsed.model_id)):
        return parsed, None
    return parsed, _densify_or_error(parsed)


def _densify_or_error(parsed: ParsedForwardBackward) -> _Densified:
    """The densified call, or the error that refuses it (raised by the route once the seq id is tracked)."""
    try:
        return _densify(parsed)
    except (WireError, InvalidWork) as exc:
        return exc


def _densify(parsed: ParsedForwardBackward) -> tuple[ForwardBackwardCall, ForwardBackwardWork]:
    """The call and its domain work (WireErrors carry the ids)."""
    call = parsed.densify()
    if call.seq_id is None:
        raise WireError("seq_id", "is required (>= 1, consecutive per model)", model_id=call.model_id)
    return call, forward_backward_work(call, AdapterId(call.model_id))


@router.post("/optim_step", response_model=UntypedAPIFuture)
@documents_body(OptimStepRequest)
async def optim_step(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """Apply the accumulated gradients with AdamW (`adam_params`); result: `OptimStepResponse`."""
    async with SeqIdGuard(control, tenant) as guard:
        request = parse_body(OptimStepRequest, body)
        guard.track(request.model_id, request.seq_id)
        seq_id = require_seq_id(request.seq_id)
        params = adam_params(request.optim_params, "adam_params")
        submitted = await control.optim_step(tenant, ModelId(request.model_id), seq_id, params)
    return wire_json(UntypedAPIFuture(request_id=submitted.request_id, model_id=request.model_id))


def require_seq_id(seq_id: int | None) -> int:
    """Training requests must say where they go in the model's sequence."""
    if seq_id is None:
        raise WireError("seq_id", "is required (>= 1, consecutive per model)")
    return seq_id


@router.post("/unload_model", response_model=UntypedAPIFuture)
@documents_body(UnloadModelRequest)
async def unload_model(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """Free a model's adapter after its queued requests (its checkpoints stay); result: `UnloadModelResponse`."""
    request = parse_body(UnloadModelRequest, body)
    submitted = await control.unload_model(tenant, ModelId(request.model_id))
    return wire_json(UntypedAPIFuture(request_id=submitted.request_id, model_id=request.model_id))
