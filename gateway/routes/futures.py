"""Futures of the Tinker API: retrieve_future (long-poll), retrieve_futures, cancel_future.

`retrieve_future` holds the request up to `long_poll_seconds` (the SDK re-polls *immediately* on
`try_again`, and its read timeout is 45 s; each hold is cut short by a random 0-20 % so that polls opened
together do not all come back in the same instant), then answers per protocol §3.2, always with HTTP 200:
- pending → `{"type": "try_again", "request_id", "queue_state"}`;
- failed → `{"error", "category"}` (the SDK raises `RequestFailedError`);
- done → the kind's result: protobuf for forward / forward_backward / sample when `Accept` asks for
  `application/x-protobuf` (SDK 0.38 always does), JSON otherwise.
Only an unknown (or another tenant's) request id is a 404, which the SDK treats as fatal.
"""

from __future__ import annotations

import random

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from gateway.deps import Control, CurrentTenant, RawBody, RenderCache, SettingsDep, documents_body, parse_body
from gateway.errors import unsupported
from gateway.rendering import (
    failed_payload,
    safe_result_payload,
    tinker_result_response,
    wants_protobuf,
    wire_json,
)
from services.control.api import Done, Failed, Pending
from services.db.ids import RequestId
from services.wire.control import CancelFutureRequest, FutureRetrieveRequest, FuturesRetrieveRequest
from services.wire.responses import TryAgainResponse

router = APIRouter(prefix="/api/v1", tags=["futures"])

LONG_POLL_JITTER = 0.2
"""Fraction of `long_poll_seconds` a hold may be shortened by, at random: hundreds of long-polls opened at
once (a client starting many requests) would otherwise all time out and re-poll in one burst, every cycle."""

PAUSED_REASONS = {
    "paused_capacity": "the server is at capacity; the request is queued",
    "paused_rate_limit": "the tenant's rate limit is reached; the request is queued",
}


def try_again(request_id: str, pending: Pending) -> TryAgainResponse:
    return TryAgainResponse(
        request_id=request_id,
        queue_state=pending.queue_state,
        queue_state_reason=PAUSED_REASONS.get(pending.queue_state),
    )


@router.post("/retrieve_future")
@documents_body(FutureRetrieveRequest)
async def retrieve_future(
    request: Request, tenant: CurrentTenant, control: Control, settings: SettingsDep, render: RenderCache,
    body: RawBody,
) -> Response:
    """Long-poll one future (answers `TryAgainResponse`, `RequestFailedResponse`, or the result)."""
    poll = parse_body(FutureRetrieveRequest, body)
    hold = settings.long_poll_seconds * (1.0 - LONG_POLL_JITTER * random.random())
    state = await control.retrieve(tenant, RequestId(poll.request_id), hold)
    if isinstance(state, Pending):
        return wire_json(try_again(poll.request_id, state))
    if isinstance(state, Failed):
        return wire_json(failed_payload(state))
    assert isinstance(state, Done)
    payload = safe_result_payload(poll.request_id, state, render.get(poll.request_id))
    return tinker_result_response(payload, protobuf=wants_protobuf(request.headers.get("accept")))


@router.post("/retrieve_futures")
@documents_body(FuturesRetrieveRequest)
async def retrieve_futures(_: CurrentTenant, body: RawBody) -> JSONResponse:
    """Not served: `client/config` leaves `sample_use_retrieve_futures` off, so the SDK polls one by one."""
    parse_body(FuturesRetrieveRequest, body)
    raise unsupported("retrieve_futures", "poll each request with retrieve_future")


class CancelledFuture(BaseModel):
    """Answer of `cancel_future` (the SDK ignores it)."""

    request_id: str
    cancelled: bool = True


@router.post("/cancel_future", response_model=CancelledFuture)
@documents_body(CancelFutureRequest)
async def cancel_future(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """Abandon a request (best effort: one already running finishes)."""
    request = parse_body(CancelFutureRequest, body)
    await control.cancel(tenant, RequestId(request.request_id))
    return JSONResponse(CancelledFuture(request_id=request.request_id).model_dump())
