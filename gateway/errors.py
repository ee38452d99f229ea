"""Every error the gateway answers, as JSON: exception types, their handlers, and the seq_id guard.

Rules (protocol §1.5, §6.1): every 4xx carries a JSON body naming the offending field and the limit
(`{"detail": ..., "field": ...}`) — a bare 400 makes the SDK rebuild its connection pool and retry;
duplicates are never 409 (the SDK retries 409); permanent errors use 400/401/404/413, transient ones
429/503 (retried by the SDK). Unsupported features answer 404 rather than 501: the SDK retries every
5xx for five minutes, a 404 fails at once with our message. A training submission rejected here still
consumes its seq_id (`SeqIdGuard`), or every later request of that model would wait forever.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from types import TracebackType

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.auth import API_KEY_HEADER, CredentialError
from services.auth.tenants import Tenant
from services.control.api import ControlError, ControlPlane, QuotaExceeded
from services.db.ids import ModelId
from services.domain.validation import InvalidWork
from services.wire import WireError
from services.wire.errors import format_loc

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error raised by the gateway itself, with its HTTP status."""

    def __init__(self, status: int, detail: str, *, field: str | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.field = field


def unsupported(feature: str, hint: str = "") -> ApiError:
    """A 404 for an endpoint or option this server does not implement (404: the SDK does not retry it)."""
    text = f"{feature} is not supported by this server"
    return ApiError(404, f"{text}; {hint}" if hint else text)


class BodyTooLarge(Exception):
    """A request body over `max_body_bytes` (raised while the body streams in)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds the limit of {limit} bytes")
        self.limit = limit


def error_response(
    status: int, detail: str, *, field: str | None = None, headers: Mapping[str, str] | None = None,
    **extra: object,
) -> JSONResponse:
    """The uniform error body: `detail`, plus `field` when one input is to blame."""
    body: dict[str, object] = {"detail": detail}
    if field is not None:
        body["field"] = field
    body.update(extra)
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def body_too_large_response(limit: int) -> JSONResponse:
    return error_response(413, f"request body exceeds the limit of {limit} bytes", field="body", limit=limit)


def retry_after_headers(retry_after_s: float) -> dict[str, str]:
    # `retry-after-ms` is preferred by the SDK; `Retry-After` (whole seconds) is for everyone else.
    seconds = max(1, math.ceil(retry_after_s))
    return {"Retry-After": str(seconds), "retry-after-ms": str(max(1, round(retry_after_s * 1000)))}


async def _wire_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, WireError)
    return error_response(400, str(exc), field=exc.field, message=exc.message)


async def _invalid_work(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidWork)
    return error_response(400, str(exc), field=exc.field, message=exc.message)


async def _control_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ControlError)
    if isinstance(exc, QuotaExceeded):
        return error_response(
            429, exc.message, field=exc.field, headers=retry_after_headers(exc.retry_after_s),
            retry_after_s=exc.retry_after_s,
        )
    # Never 409 (retried by the SDK); the control plane's statuses are 400/404/429/503 by contract.
    status = 400 if exc.status == 409 else exc.status
    return error_response(status, exc.message, field=exc.field)


async def _credential_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CredentialError)
    # `error="invalid_token"` only for a dead JWT: it makes the SDK exchange its key for a new one.
    challenge = 'Bearer error="invalid_token"' if exc.invalid_token else "Bearer"
    return error_response(401, exc.message, field=API_KEY_HEADER, headers={"WWW-Authenticate": challenge})


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.detail, field=exc.field)


async def _body_too_large(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BodyTooLarge)
    return body_too_large_response(exc.limit)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request")
    first = errors[0]
    field = format_loc(tuple(first.get("loc", ())))
    return error_response(400, f"{field}: {first.get('msg', 'invalid')}", field=field)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no such endpoint: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        detail = f"method {request.method} is not allowed on {request.url.path}"
    return error_response(exc.status_code, str(detail), headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Register the JSON handlers above (unexpected exceptions are caught by `EdgeMiddleware`)."""
    app.add_exception_handler(WireError, _wire_error)
    app.add_exception_handler(InvalidWork, _invalid_work)
    app.add_exception_handler(ControlError, _control_error)
    app.add_exception_handler(CredentialError, _credential_error)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(BodyTooLarge, _body_too_large)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


class SeqIdGuard:
    """Consume a training submission's seq_id when the edge rejects it (protocol §6.1).

    Wrap the whole handling of a training submission in `async with SeqIdGuard(control, tenant) as g:`
    and call `g.track(model_id, seq_id)` once they are known. A `WireError` or `InvalidWork` leaving
    the block calls `control.reject_seq_id` (ids from the error, else the tracked ones) and is re-raised
    for its 400. Control-plane errors are not touched: a 429/503 is retried by the SDK with the same
    seq_id, and the control plane accounts for the submissions it refuses itself.
    """

    def __init__(self, control: ControlPlane, tenant: Tenant) -> None:
        self._control = control
        self._tenant = tenant
        self._model_id: str | None = None
        self._seq_id: int | None = None

    def track(self, model_id: str | None, seq_id: int | None) -> None:
        self._model_id, self._seq_id = model_id, seq_id

    async def __aenter__(self) -> SeqIdGuard:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, (WireError, InvalidWork)):
            await self._reject(exc)

    async def _reject(self, exc: WireError | InvalidWork) -> None:
        model_id = (exc.model_id if isinstance(exc, WireError) else None) or self._model_id
        seq_id = exc.seq_id if isinstance(exc, WireError) and exc.seq_id is not None else self._seq_id
        if model_id is None or seq_id is None:
            return
        try:
            await self._control.reject_seq_id(self._tenant, ModelId(model_id), seq_id, str(exc))
        except ControlError as err:
            # E.g. the model is unknown or not the caller's: nothing to unblock.
            log.debug("reject_seq_id(%s, %s) refused: %s", model_id, seq_id, err.message)
        except Exception:
            log.exception("reject_seq_id(%s, %s) failed", model_id, seq_id)
