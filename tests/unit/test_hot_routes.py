"""The hot routes served from the edge (`gateway.hot_routes`): same answers as through FastAPI, without it.

Parity: every case below is sent to an app with the short path and to one without it (`hot_routes=False`),
and status, body, the headers clients act on and what reached the control plane must be equal. Then: the
short path really skips FastAPI's dependency solver, honours dependency overrides, labels its metrics by
the route, and refuses at build time an endpoint it could not serve exactly as FastAPI would.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import fastapi.routing
import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from gateway.deps import current_tenant
from gateway.hot_routes import HOT_PATHS, HotRoutes, NotHot, hot_endpoints
from services.auth.tenants import Tenant
from services.control.api import ControlError, NotFound, QuotaExceeded
from tests.unit.test_gateway_http import AUTH, PROTO, TENANT, RecordingControl, fwdbwd_proto, make_client

Case = tuple[str, dict[str, str], bytes]

CASES: dict[str, Case] = {
    "retrieve: no key": ("/api/v1/retrieve_future", {}, b'{"request_id": "r-1"}'),
    "retrieve: wrong key": ("/api/v1/retrieve_future", {"X-API-Key": "tml-" + "c" * 43}, b'{"request_id": "r"}'),
    "retrieve: unknown id": ("/api/v1/retrieve_future", AUTH, b'{"request_id": "r-1"}'),
    "retrieve: bad json": ("/api/v1/retrieve_future", AUTH, b'{"request_id": '),
    "retrieve: wrong type": ("/api/v1/retrieve_future", AUTH, b'{"request_id": 5}'),
    "retrieve: empty body": ("/api/v1/retrieve_future", AUTH, b""),
    "optim: bad params": ("/api/v1/optim_step", AUTH,
                          b'{"model_id": "s:train:0", "seq_id": 3, "adam_params": {"learning_rate": "x"}}'),
    "optim: no seq id": ("/api/v1/optim_step", AUTH,
                         b'{"model_id": "s:train:0", "adam_params": {"learning_rate": 0.001}}'),
    "optim: accepted body": ("/api/v1/optim_step", AUTH,
                             b'{"model_id": "s:train:0", "seq_id": 2, "adam_params": {"learning_rate": 0.001}}'),
    "fb: malformed protobuf": ("/api/v1/forward_backward", PROTO, b"\xff\xff\xff"),
    "fb: unknown loss": ("/api/v1/forward_backward", PROTO, fwdbwd_proto("no_such_loss")),
    "fb: valid": ("/api/v1/forward_backward", PROTO, fwdbwd_proto()),
    "fb: too large": ("/api/v1/forward_backward", PROTO, b"\x00" * (300 * 1024)),
    "asample: no session": ("/api/v1/asample", AUTH, b'{"prompt": {"chunks": []}, "num_samples": 1}'),
    "heartbeat": ("/api/v1/session_heartbeat", AUTH, b'{"session_id": "s"}'),
    "futures: batched": ("/api/v1/retrieve_futures", AUTH, b'{"target": {"sampling_session_id": "s:sample:0"}}'),
}
SEEN_HEADERS = ("content-type", "retry-after", "retry-after-ms", "www-authenticate")


def answer(client: TestClient, control: RecordingControl, case: Case) -> tuple[object, ...]:
    path, headers, body = case
    response = client.post(path, content=body, headers={**headers, "X-Request-Id": "req-1"})
    try:
        content: object = response.json()
    except json.JSONDecodeError:
        content = response.content
    kept = {name: response.headers.get(name) for name in SEEN_HEADERS}
    return response.status_code, content, kept, response.headers["x-request-id"], [n for n, _, _ in control.calls]


def both(error: Exception | None = None, **settings: Any) -> Iterator[tuple[TestClient, RecordingControl, bool]]:
    for hot in (True, False):
        control = RecordingControl(error)
        with make_client(control, hot_routes=hot, max_body_bytes=256 * 1024, fwdbwd_max_chunk_bytes_count=4096,
                         **settings) as client:
            yield client, control, hot


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_short_path_answers_like_fastapi(name: str) -> None:
    answers = [answer(client, control, CASES[name]) for client, control, _ in both()]
    assert answers[0] == answers[1], name
    assert answers[0][0] in (200, 400, 401, 404, 413), answers[0]


@pytest.mark.parametrize(("error", "status"), [
    (QuotaExceeded("too many requests", retry_after_s=2.5), 429), (ControlError("bad", field="f"), 400),
    (NotFound("no such session", field="session_id"), 404),
])
def test_control_plane_errors_answer_alike(error: Exception, status: int) -> None:
    answers = [answer(client, control, CASES["heartbeat"]) for client, control, _ in both(error)]
    assert answers[0] == answers[1] and answers[0][0] == status


def test_an_unexpected_error_is_the_edge_500_on_both_paths(caplog: pytest.LogCaptureFixture) -> None:
    answers = [answer(client, control, CASES["heartbeat"]) for client, control, _ in both(RuntimeError("internal"))]
    assert answers[0] == answers[1]
    assert answers[0][:2] == (500, {"detail": "internal server error", "request_id": "req-1"})
    assert "internal" in caplog.text


def test_hot_routes_skip_fastapis_dependency_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    solved = count_calls(monkeypatch, fastapi.routing, "solve_dependencies")
    for client, control, hot in both():
        solved.clear()
        answer(client, control, CASES["retrieve: unknown id"])
        assert (len(solved) == 0) is hot
        client.post("/api/v1/get_info", json={"model_id": "m"}, headers=AUTH)  # not a hot route: FastAPI's
        assert solved


def test_dependency_overrides_send_the_request_through_fastapi(monkeypatch: pytest.MonkeyPatch) -> None:
    other = Tenant(TENANT.id, "overridden", False, TENANT.quotas)
    control = RecordingControl()
    with make_client(control) as client:
        client.app.dependency_overrides[current_tenant] = lambda: other  # type: ignore[attr-defined]
        response = client.post("/api/v1/retrieve_future", json={"request_id": "r-1"})  # no key: overridden
    assert response.status_code == 404 and control.called("retrieve")


def test_hot_routes_are_labelled_by_their_route_in_the_metrics() -> None:
    with make_client(RecordingControl()) as client:
        client.post("/api/v1/retrieve_future", json={"request_id": "r-1"}, headers=AUTH)
        text = client.get("/metrics").text
    assert 'carpool_http_requests_total{method="POST",route="/api/v1/retrieve_future",status="404"} 1.0' in text


def test_every_hot_path_is_a_route_of_the_app() -> None:
    with make_client(RecordingControl()) as client:
        endpoints = hot_endpoints(client.app)  # type: ignore[arg-type]
    assert set(endpoints) == set(HOT_PATHS)


async def _state_value(request: Request) -> int:
    return 1


def _sync_value() -> int:
    return 1


async def _generated_value() -> Any:
    yield 1


async def _takes_a_query(value: int) -> JSONResponse:
    return JSONResponse({})


async def _takes_a_sync_dependency(value: Annotated[int, Depends(_sync_value)]) -> JSONResponse:
    return JSONResponse({})


async def _takes_a_generator_dependency(value: Annotated[int, Depends(_generated_value)]) -> JSONResponse:
    return JSONResponse({})


def _sync_endpoint(value: Annotated[int, Depends(_state_value)]) -> JSONResponse:
    return JSONResponse({})


async def _returns_data(request: Request) -> dict[str, int]:
    return {"a": 1}


@pytest.mark.parametrize(("endpoint", "fragment"), [
    (_takes_a_query, "parameters other than"), (_takes_a_sync_dependency, "not a coroutine"),
    (_takes_a_generator_dependency, "not a coroutine"), (_sync_endpoint, "not a coroutine"),
    (_returns_data, "not declared to return a Response"),
])
def test_an_endpoint_the_short_path_cannot_serve_exactly_fails_the_build(endpoint: Any, fragment: str) -> None:
    app = FastAPI()
    app.post("/x")(endpoint)
    with pytest.raises(NotHot, match=fragment):
        hot_endpoints(app, [("POST", "/x")])
    with pytest.raises(NotHot, match="no route"):
        hot_endpoints(app, [("POST", "/y")])


SHARED_CALLS: list[str] = []


async def _shared(request: Request) -> int:
    SHARED_CALLS.append("shared")
    return 2


async def _derived(request: Request, base: Annotated[int, Depends(_shared)]) -> int:
    return base * 10


async def _uses_both(request: Request, a: Annotated[int, Depends(_shared)],
                     b: Annotated[int, Depends(_derived)]) -> JSONResponse:
    return JSONResponse({"a": a, "b": b, "path": request.url.path})


def test_a_servable_endpoint_runs_each_dependency_once() -> None:
    app = FastAPI()
    app.post("/x")(_uses_both)
    app.add_middleware(HotRoutes, endpoints=hot_endpoints(app, [("POST", "/x")]))
    app.router.routes.clear()  # only the short path can answer now
    SHARED_CALLS.clear()
    response = TestClient(app).post("/x")
    assert response.json() == {"a": 2, "b": 20, "path": "/x"} and SHARED_CALLS == ["shared"]


def count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[object]:
    calls: list[object] = []
    original: Callable[..., Any] = getattr(module, name)

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return await original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls
