"""OpenAPI for routes whose bodies are parsed by hand: the `documents_body` marker and the schema hook.

Routes read raw bodies (see `gateway.deps`), so FastAPI cannot see their request models. A route marks
its endpoint with `@documents_body(Model)` (or `(content_type, Model | None)` pairs, None = opaque
binary, e.g. protobuf), and `install_openapi` adds a `requestBody` referencing the model's JSON schema,
with nested models registered under `components.schemas`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

F = TypeVar("F", bound=Callable[..., Any])
BodySpec = tuple[str, type[BaseModel] | None]
_BODY_ATTR = "__carpool_request_body__"
JSON = "application/json"
REF_TEMPLATE = "#/components/schemas/{model}"


def documents_body(*specs: type[BaseModel] | BodySpec) -> Callable[[F], F]:
    """Mark an endpoint as taking these bodies (a bare model means `application/json`)."""
    normalized: list[BodySpec] = [(JSON, s) if isinstance(s, type) else s for s in specs]

    def mark(endpoint: F) -> F:
        setattr(endpoint, _BODY_ATTR, tuple(normalized))
        return endpoint

    return mark


def install_openapi(app: FastAPI) -> None:
    """Replace `app.openapi` with a generator that also documents hand-parsed bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _build(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components: dict[str, Any] = schema.setdefault("components", {}).setdefault("schemas", {})
    for route in app.routes:
        specs: tuple[BodySpec, ...] | None = getattr(getattr(route, "endpoint", None), _BODY_ATTR, None)
        if not isinstance(route, APIRoute) or not specs:
            continue
        content = {ctype: {"schema": _schema_ref(model, components)} for ctype, model in specs}
        for method in route.methods:
            operation = schema["paths"][route.path_format].get(method.lower())
            if operation is not None:
                operation["requestBody"] = {"required": True, "content": content}
    return schema


def _schema_ref(model: type[BaseModel] | None, components: dict[str, Any]) -> dict[str, Any]:
    if model is None:
        return {"type": "string", "format": "binary"}
    if model.__name__ not in components:
        js = model.model_json_schema(ref_template=REF_TEMPLATE)
        components.update(js.pop("$defs", {}))
        components[model.__name__] = js
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}
