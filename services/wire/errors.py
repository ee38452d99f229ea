"""Validation failures of wire input: `WireError`, and turning pydantic errors and raw bodies into it.

Everything in `services.wire` that rejects client input raises `WireError` naming the offending field
(dotted path, `[i]` for list positions) and the violated limit, so the gateway can answer one uniform
HTTP 400 body. A rejected *training* submission must still consume its `seq_id` (protocol §6.1), so a
`WireError` carries the `model_id` / `seq_id` of the body whenever they could be read before the failure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

import pydantic

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


class WireError(ValueError):
    """Client input that breaks the wire contract: `field` names where, `message` says which limit."""

    def __init__(
        self,
        field: str,
        message: str,
        *,
        model_id: str | None = None,
        seq_id: int | None = None,
    ) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        """Dotted path of the offending field, e.g. `data[2].loss_fn_inputs.weights.dtype`."""
        self.message = message
        """What is wrong, including the limit (e.g. `must be >= 1, got 0`)."""
        self.model_id = model_id
        """The body's `model_id` when it could be read, so the gateway can still consume `seq_id`."""
        self.seq_id = seq_id
        """The body's `seq_id` when it could be read (see `model_id`)."""

    def with_ids(self, model_id: str | None, seq_id: int | None) -> WireError:
        """A copy that also carries the request's ids (used when ids become known after the failure)."""
        return WireError(
            self.field,
            self.message,
            model_id=self.model_id if self.model_id is not None else model_id,
            seq_id=self.seq_id if self.seq_id is not None else seq_id,
        )

    def to_detail(self) -> dict[str, str]:
        """A JSON-able error body; the SDK shows any JSON body in its exception text."""
        return {"detail": str(self), "field": self.field, "message": self.message}


def format_loc(loc: tuple[int | str, ...]) -> str:
    """Render a pydantic error location as `a.b[3].c` (the body itself is `body`)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


def wire_error_from_validation(exc: pydantic.ValidationError, raw: object = None) -> WireError:
    """Convert the first pydantic error into a `WireError`, keeping ids readable from `raw`."""
    first = exc.errors(include_url=False)[0]
    message = first["msg"]
    # pydantic's message already states the limit for range errors; add the offending value.
    if first["type"] != "missing" and not isinstance(first.get("input"), (dict, list)):
        message = f"{message} (got {_short_repr(first.get('input'))})"
    model_id, seq_id = _peek_ids(raw)
    loc = tuple(first["loc"])
    if raw is not None:
        loc = _body_path(loc, raw, keep_last=first["type"] == "missing")
    return WireError(format_loc(loc), message, model_id=model_id, seq_id=seq_id)


def parse_request(model: type[ModelT], body: bytes | str | Mapping[str, Any]) -> ModelT:
    """Validate a JSON request body (raw bytes/str or already-parsed mapping) into `model`.

    Raises `WireError` for unparsable JSON, a non-object body, or any field that fails validation.
    """
    raw: object
    if isinstance(body, (bytes, str)):
        try:
            raw = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise WireError("body", f"is not valid JSON: {exc}") from exc
        except RecursionError as exc:  # json.loads recurses per nesting level
            raise WireError("body", "is nested too deeply to be a request body") from exc
    else:
        raw = body
    if not isinstance(raw, Mapping):
        raise WireError("body", f"must be a JSON object, got {type(raw).__name__}")
    try:
        return model.model_validate(dict(raw))
    except pydantic.ValidationError as exc:
        raise wire_error_from_validation(exc, raw) from exc


def _body_path(loc: tuple[int | str, ...], raw: object, *, keep_last: bool) -> tuple[int | str, ...]:
    """Keep only the parts of a pydantic location that are keys/indices of the body itself.

    pydantic inserts union member labels (`adam`, `list[int]`, ...) into locations; clients should see
    the path of what they sent. With `keep_last` the last part is kept anyway (it names a missing key).
    """
    kept: list[int | str] = []
    node = raw
    for i, part in enumerate(loc):
        if _has_child(node, part):
            node = node[part]  # type: ignore[index]
        elif not (keep_last and i == len(loc) - 1):
            continue
        kept.append(part)
    return tuple(kept)


def _has_child(node: object, part: int | str) -> bool:
    if isinstance(node, Mapping):
        return part in node
    return isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)


def _peek_ids(raw: object) -> tuple[str | None, int | None]:
    """Best-effort `model_id` / `seq_id` of a raw body, only when they have the right types."""
    if not isinstance(raw, Mapping):
        return None, None
    model_id = raw.get("model_id")
    seq_id = raw.get("seq_id")
    return (
        model_id if isinstance(model_id, str) else None,
        seq_id if isinstance(seq_id, int) and not isinstance(seq_id, bool) else None,
    )


def _short_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
