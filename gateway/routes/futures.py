"""Futures of the Tinker API: retrieve_future (long-poll), retrieve_futures (batched), cancel_future.

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
from gateway.rendering import (
    failed_payload,
    safe_result_payload,
    tinker_result_response,
    wants_protobuf,
    wire_json,
)
from services.control.api import Done, Failed, Pending
from services.db.ids import RequestId, SamplingSessionId
from services.wire.control import CancelFutureRequest, FutureRetrieveRequest, FuturesRetrieveRequest
from services.wire.responses import FutureFailed, FutureFinished, FuturesRetrieveResponse, TryAgainResponse

router = APIRouter(prefix="/api/v1", tags=["futures"])

LONG_POLL_JITTER = 0.2
"""Fraction of `long_poll_seconds` a hold may be shortened by, at random: hundreds of long-polls opened at
once (a client starting many requests) would otherwise all time out and re-poll in one burst, every cycle."""
_JITTER = random.SystemRandom()
"""The jitter's source: the OS's, which keeps no state here. Drawing from the process-wide generator would move
the sequence of whatever else shares the process and seeded it (an embedding application, a test run; the
suite's property tests warn when it moves under them)."""

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
    hold = settings.long_poll_seconds * (1.0 - LONG_POLL_JITTER * _JITTER.random())
    with request.app.state.metrics.long_polls.track_inprogress():
        state = await control.retrieve(tenant, RequestId(poll.request_id), hold)
    if isinstance(state, Pending):
        return wire_json(try_again(poll.request_id, state))
    if isinstance(state, Failed):
        return wire_json(failed_payload(state))
    assert isinstance(state, Done)
    payload = safe_result_payload(poll.request_id, state, render.get(poll.request_id))
    return tinker_result_response(payload, protobuf=wants_protobuf(request.headers.get("accept")))


@router.post("/retrieve_futures", response_model=FuturesRetrieveResponse)
@documents_body(FuturesRetrieveRequest)
async def retrieve_futures(tenant: CurrentTenant, control: Control, settings: SettingsDep,
                           body: RawBody) -> JSONResponse:
    """The batched poller of a sampling client: the target's requests finished since `prev_cursor` (held up
    to `long_poll_seconds` while there are none; `timeout: 0` answers at once). The cursor stays put when
    nothing new finished. The SDK then fetches each payload with `retrieve_future`."""
    poll = parse_body(FuturesRetrieveRequest, body)
    hold = settings.long_poll_seconds if poll.timeout is None else min(poll.timeout, settings.long_poll_seconds)
    page = await control.retrieve_futures(tenant, SamplingSessionId(poll.target.sampling_session_id),
                                          poll.target.cloned_sampler_id, poll.prev_cursor, hold)
    completions: list[FutureFinished | FutureFailed] = [
        FutureFailed(request_id=c.request_id) if c.failed else FutureFinished(request_id=c.request_id)
        for c in page.completions
    ]
    return wire_json(FuturesRetrieveResponse(completions=completions, cursor=page.cursor))


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
