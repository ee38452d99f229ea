"""HTTP-layer behaviour of the gateway: auth headers, body limits, malformed bodies, JSON errors, id routing,
middleware (request id, metrics, last-resort 500), unsupported endpoints, settings, OpenAPI.

These tests need no service core. They run `create_app` against `RecordingControl`, an HTTP-layer test
double that records each call and answers it by raising (NotFound unless told otherwise) — so a test
can see *what* reached the control plane (ids with `:` and `/`, consumed seq ids) without faking any
control-plane behaviour. End-to-end behaviour against the real control plane lives in
`test_gateway_service.py`.
"""

from __future__ import annotations

import inspect
import json
import logging
import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zstandard
from fastapi import FastAPI
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from gateway.app import create_app
from gateway.routes.futures import LONG_POLL_JITTER
from gateway.settings import GatewaySettings
from services.auth.invalidation import Invalidation
from services.auth.tenants import Tenant
from services.control.api import ControlError, ControlPlane, NotFound, QuotaExceeded, Unavailable
from services.db.ids import TenantId
from services.db.tenants import TenantQuotas

KEY = "tml-" + "a" * 43
OTHER_KEY = "tml-" + "b" * 43
TENANT = Tenant(TenantId("tenant-1"), "acme", False, TenantQuotas())
AUTH = {"X-API-Key": KEY}


class StaticAuthenticator:
    """HTTP-layer test double: one known key."""

    def __init__(self) -> None:
        self.revoked = False

    async def authenticate(self, api_key: str) -> Tenant | None:
        return TENANT if api_key == KEY and not self.revoked else None

    async def revoke(self, tenant: Tenant) -> bool:
        self.revoked = True
        return True

    async def announce(self, invalidation: Invalidation) -> None:
        self.revoked = self.revoked or invalidation.tenant_id == TENANT.id


CONTROL_OPERATIONS = frozenset(n for n in vars(ControlPlane) if not n.startswith("_"))


class RecordingControl:
    """HTTP-layer test double of `ControlPlane`: records every call, then raises `error` (NotFound)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.error = error or NotFound("no such thing", field="id")

    def __getattr__(self, name: str) -> Any:
        if name not in CONTROL_OPERATIONS:
            raise AttributeError(name)

        if not inspect.iscoroutinefunction(getattr(ControlPlane, name)):
            def answer(*args: Any, **kwargs: Any) -> bool:
                self.calls.append((name, args[1:], kwargs))
                if name == "model_known_owned":
                    return False  # nothing in memory: the route asks get_info, as for a model not seen yet
                raise self.error

            return answer

        async def call(*args: Any, **kwargs: Any) -> None:
            self.calls.append((name, args[1:], kwargs))  # drop the tenant
            # get_info: forward_backward's ownership check; authenticate_token: an unknown JWT (None)
            if name not in ("reject_seq_id", "get_info", "authenticate_token"):
                raise self.error

        return call

    def called(self, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(a, k) for n, a, k in self.calls if n == name]


def make_client(control: Any = None, **settings: Any) -> TestClient:
    app = create_app(GatewaySettings(**settings), control or RecordingControl(), StaticAuthenticator())
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture
def control() -> RecordingControl:
    return RecordingControl()


@pytest.fixture
def client(control: RecordingControl) -> Iterator[TestClient]:
    with make_client(control) as c:
        yield c


def fwdbwd_proto(loss_fn: str = "cross_entropy", seq_id: int = 1) -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={
            "target_tokens": np.array([2, 3, 4, 5], dtype=np.int64),
            "weights": np.array([0, 1, 1, 1], dtype=np.float32),
        },
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn),
        model_id="sess-x:train:0",
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


PROTO = {"Content-Type": "application/x-protobuf", **AUTH}


# -- long-poll jitter --------------------------------------------------------------------------------

def test_the_long_poll_jitter_leaves_the_process_wide_generator_alone(client: TestClient,
                                                                     control: RecordingControl,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each hold is cut short by a random 0-20 %, drawn without moving `random`'s shared sequence (which a
    seeded application or test in the same process relies on). The process-wide functions are spied on, not
    `random.getstate()` compared: another thread of the run (an SDK client's retry) may draw meanwhile."""
    drawn_by_gateway: list[str] = []

    def spy(name: str) -> Any:
        original = getattr(random, name)

        def draw(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("gateway."):
                drawn_by_gateway.append(f"{caller} called random.{name}")
            return original(*args, **kwargs)
        return draw

    for name in ("random", "uniform", "randint", "choice", "getrandbits"):
        monkeypatch.setattr(random, name, spy(name))
    for _ in range(20):
        assert client.post("/api/v1/retrieve_future", json={"request_id": "r-1"}, headers=AUTH).status_code == 404
    assert drawn_by_gateway == []
    holds = [args[1] for args, _ in control.called("retrieve")]
    long_poll = GatewaySettings().long_poll_seconds
    assert len(holds) == 20 and all((1 - LONG_POLL_JITTER) * long_poll <= h <= long_poll for h in holds)
    assert len(set(holds)) > 1  # jittered, not one fixed hold


# -- auth ------------------------------------------------------------------------------------------


def test_missing_key_is_401_with_a_json_message(client: TestClient) -> None:
    response = client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"})
    assert response.status_code == 401
    body = response.json()
    assert "X-API-Key" in body["detail"] and body["field"] == "X-API-Key"
    assert "invalid_token" not in response.headers.get("www-authenticate", "")


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        ({"X-API-Key": OTHER_KEY}, "invalid API key"),
        ({"X-API-Key": "eyJhbGciOi.x.y"}, "JWT"),
        ({"Authorization": f"Basic {KEY}"}, "Bearer"),
        ({"Authorization": "Bearer "}, "missing API key"),
    ],
)
def test_bad_credentials_are_401(client: TestClient, headers: dict[str, str], fragment: str) -> None:
    response = client.post("/api/v1/client/config", json={}, headers=headers)
    assert response.status_code == 401 and fragment in response.json()["detail"]


def test_bearer_key_is_accepted(client: TestClient) -> None:
    response = client.post("/api/v1/client/config", json={}, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200


def test_revoked_key_stops_working(client: TestClient) -> None:
    assert client.delete("/api/v1/auth/apikey/me", headers=AUTH).json() == {"revoked": True}
    assert client.post("/api/v1/client/config", json={}, headers=AUTH).status_code == 401


def test_keys_never_reach_the_logs(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    client.post("/api/v1/client/config", json={}, headers={"X-API-Key": OTHER_KEY})
    logging.getLogger("uvicorn.access").info("GET /x?key=%s", OTHER_KEY)
    assert OTHER_KEY not in caplog.text
    assert logging.getLogger("uvicorn.access").filters  # the redaction filter is installed


# -- client config, health, auth CLI ---------------------------------------------------------------


def test_client_config_validates_in_the_sdk_and_reflects_settings() -> None:
    with make_client(proto_compress_fwdbwd=True, fwdbwd_max_chunk_len=64) as c:
        response = c.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers=AUTH)
    assert response.status_code == 200
    config = types.ClientConfigResponse.model_validate_json(response.content, strict=True)
    assert config.use_pyqwest_transport is False and config.pjwt_auth_enabled is False
    assert config.proto_compress_fwdbwd is True and config.fwdbwd_max_chunk_len == 64


def test_dynamic_config_validates_in_the_sdk(client: TestClient) -> None:
    response = client.post("/api/v1/client/dynamic_config", json={"sdk_version": "0.38.0"}, headers=AUTH)
    config = types.ClientDynamicConfigResponse.model_validate_json(response.content, strict=True)
    assert config.refresh_interval_sec == 300 and config.sample_cancel_enabled is False


def test_healthz_needs_no_key(client: TestClient) -> None:
    assert client.get("/api/v1/healthz").json() == {"status": "ok"}


def test_auth_cli_key_endpoint_matches_the_cli_model(client: TestClient) -> None:
    from tinker.cli.auth_api import SelfApiKeyResponse

    response = client.get("/api/v1/auth/apikey/me", headers=AUTH)
    assert SelfApiKeyResponse.model_validate(response.json()).details.org_details.name == "acme"


# -- bodies ----------------------------------------------------------------------------------------


def test_declared_oversized_body_is_413_before_reading() -> None:
    with make_client(max_body_bytes=1 << 20, fwdbwd_max_chunk_bytes_count=4096) as c:
        response = c.post("/api/v1/forward_backward", content=b"\0" * ((1 << 20) + 1), headers=PROTO)
    assert response.status_code == 413
    assert response.json()["field"] == "body" and response.json()["limit"] == 1 << 20


def test_streamed_oversized_body_is_413() -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(20):
            yield b"\0" * 65536

    with make_client(max_body_bytes=1 << 20, fwdbwd_max_chunk_bytes_count=4096) as c:
        response = c.post("/api/v1/forward_backward", content=chunks(), headers=PROTO)
    assert response.status_code == 413 and "limit" in response.json()["detail"]


def test_malformed_protobuf_is_400_naming_the_body(client: TestClient, control: RecordingControl) -> None:
    response = client.post("/api/v1/forward_backward", content=b"\xff\xff\xff\xff", headers=PROTO)
    assert response.status_code == 400
    assert response.json()["field"] == "body" and "protobuf" in response.json()["detail"]
    assert control.called("reject_seq_id") == []  # no ids could be read


def test_bad_zstd_is_400(client: TestClient) -> None:
    headers = {**PROTO, "Content-Encoding": "zstd"}
    response = client.post("/api/v1/forward_backward", content=b"not zstd at all", headers=headers)
    assert response.status_code == 400 and response.json()["field"] == "body"


def test_unknown_loss_is_400_and_consumes_the_seq_id(client: TestClient, control: RecordingControl) -> None:
    response = client.post("/api/v1/forward_backward", content=fwdbwd_proto("fancy_loss", seq_id=7), headers=PROTO)
    assert response.status_code == 400 and response.json()["field"] == "loss_fn"
    [(args, _)] = control.called("reject_seq_id")
    assert args[:2] == ("sess-x:train:0", 7) and "fancy_loss" in args[2]


def test_zstd_protobuf_reaches_the_control_plane(client: TestClient, control: RecordingControl) -> None:
    body = zstandard.ZstdCompressor().compress(fwdbwd_proto(seq_id=3))
    response = client.post("/api/v1/forward_backward", content=body, headers={**PROTO, "Content-Encoding": "zstd"})
    assert response.status_code == 404  # the double answers NotFound: decoding worked
    [(args, _)] = control.called("forward_backward")
    assert args[0] == "sess-x:train:0" and args[1] == 3 and args[2].loss_fn == "cross_entropy"


def test_legacy_json_forward_is_forward_only(client: TestClient, control: RecordingControl) -> None:
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
             "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64"},
                                "weights": {"data": [1.0, 1.0], "dtype": "float32"}}}
    body = {"model_id": "m:train:0", "seq_id": 5, "forward_input": {"data": [datum], "loss_fn": "cross_entropy"}}
    assert client.post("/api/v1/forward", json=body, headers=AUTH).status_code == 404
    [(args, _)] = control.called("forward_backward")
    assert args[:2] == ("m:train:0", 5) and args[2].forward_only is True


def test_bad_json_names_the_field_and_consumes_the_seq_id(client: TestClient, control: RecordingControl) -> None:
    body = {"model_id": "m:train:0", "seq_id": 4, "adam_params": {"learning_rate": "fast"}, "type": "optim_step"}
    response = client.post("/api/v1/optim_step", json=body, headers=AUTH)
    assert response.status_code == 400
    assert response.json()["field"] == "adam_params.learning_rate"
    assert [a[:2] for a, _ in control.called("reject_seq_id")] == [("m:train:0", 4)]


def test_non_adam_optimizer_is_400_and_consumes_the_seq_id(client: TestClient, control: RecordingControl) -> None:
    body = {"model_id": "m:train:0", "seq_id": 2, "optimizer_params": {"type": "dimuon", "learning_rate": 0.1}}
    response = client.post("/api/v1/optim_step", json=body, headers=AUTH)
    assert response.status_code == 400 and response.json()["field"] == "adam_params.type"
    assert [a[:2] for a, _ in control.called("reject_seq_id")] == [("m:train:0", 2)]


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]"])
def test_unparsable_json_is_400_with_a_body(client: TestClient, body: bytes) -> None:
    response = client.post("/api/v1/create_session", content=body, headers=AUTH)
    assert response.status_code == 400 and response.json()["field"] == "body"


def test_bad_query_parameter_is_400_naming_it(client: TestClient) -> None:
    response = client.get("/api/v1/training_runs?limit=0", headers=AUTH)
    assert response.status_code == 400 and response.json()["field"] == "query.limit"


# -- routing of ids --------------------------------------------------------------------------------


def test_sampler_ids_with_colons_route(client: TestClient, control: RecordingControl) -> None:
    response = client.get("/api/v1/samplers/sess-a:sample:0", headers=AUTH)
    assert response.status_code == 404 and response.json()["detail"] == "no such thing"
    assert control.called("get_sampler")[0][0] == ("sess-a:sample:0",)


@pytest.mark.parametrize(
    ("method", "suffix", "operation", "expected"),
    [
        ("DELETE", "weights/ck1", "delete_checkpoint", ("tinker://sess-a:train:0/weights/ck1",)),
        ("DELETE", "weights/publish", "delete_checkpoint", ("tinker://sess-a:train:0/weights/publish",)),
        ("POST", "sampler_weights/s1/publish", "set_checkpoint_public",
         ("tinker://sess-a:train:0/sampler_weights/s1", True)),
        ("DELETE", "weights/ck1/publish", "set_checkpoint_public", ("tinker://sess-a:train:0/weights/ck1", False)),
        ("GET", "external_weights/e1/external_weights_urls", "external_weights_urls",
         ("tinker://sess-a:train:0/external_weights/e1", "http://testserver")),
    ],
)
def test_checkpoint_ids_with_slashes_route(
    client: TestClient, control: RecordingControl, method: str, suffix: str, operation: str,
    expected: tuple[Any, ...],
) -> None:
    url = f"/api/v1/training_runs/sess-a:train:0/checkpoints/{suffix}"
    assert client.request(method, url, headers=AUTH).status_code == 404
    assert control.called(operation)[0][0] == expected


def test_checkpoint_ttl_route_parses_its_body(client: TestClient, control: RecordingControl) -> None:
    url = "/api/v1/training_runs/sess-a:train:0/checkpoints/weights/ck1/ttl"
    assert client.put(url, json={"ttl_seconds": 10}, headers=AUTH).json()["field"] == "ttl_seconds"
    client.put(url, json={"ttl_seconds": None}, headers=AUTH)
    assert control.called("set_checkpoint_ttl")[0][0] == ("tinker://sess-a:train:0/weights/ck1", None)


def test_bad_checkpoint_segment_is_400(client: TestClient) -> None:
    response = client.delete("/api/v1/training_runs/r:train:0/checkpoints/nope/ck1", headers=AUTH)
    assert response.status_code == 400 and response.json()["field"] == "checkpoint_id"


# -- statuses --------------------------------------------------------------------------------------


def test_quota_is_429_with_retry_after() -> None:
    with make_client(RecordingControl(QuotaExceeded("too many models", retry_after_s=2.5))) as c:
        response = c.post("/api/v1/create_session", json={}, headers=AUTH)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3" and response.headers["retry-after-ms"] == "2500"
    assert response.json()["retry_after_s"] == 2.5


@pytest.mark.parametrize(("error", "status"), [(Unavailable("busy"), 503), (ControlError("x", field="f"), 400)])
def test_control_errors_keep_their_status(error: ControlError, status: int) -> None:
    with make_client(RecordingControl(error)) as c:
        response = c.post("/api/v1/create_session", json={}, headers=AUTH)
    assert response.status_code == status and response.json()["detail"] == error.message


def test_unexpected_errors_are_a_json_500_without_internals(caplog: pytest.LogCaptureFixture) -> None:
    with make_client(RecordingControl(RuntimeError("secret internals"))) as c:
        response = c.post("/api/v1/create_session", json={}, headers={**AUTH, "X-Request-Id": "req-42"})
    assert response.status_code == 500
    assert response.json() == {"detail": "internal server error", "request_id": "req-42"}
    assert "secret internals" in caplog.text  # logged for operators, not sent to clients


@pytest.mark.parametrize(
    ("method", "url", "body", "operation"),
    [("GET", "/api/v1/audit", None, "audit_log"), ("POST", "/api/v1/sessions/search", {}, "search_sessions"),
     ("POST", "/api/v1/retrieve_futures", {"target": {"sampling_session_id": "s:sample:0"}}, "retrieve_futures"),
     ("PUT", "/api/v1/sessions/s/project", {"project_id": "p"}, "assign_session_project"),
     ("POST", "/api/v1/copy_weights", {"source_path": "tinker://s:train:0/weights/a", "destination_project_id": "p"},
      "copy_weights"),
     ("POST", "/api/v1/join_sampling_session", {"sampling_session_id": "s:sample:0"}, "join_sampling_session")],
)
def test_formerly_unsupported_endpoints_reach_the_control_plane(
    client: TestClient, control: RecordingControl, method: str, url: str, body: object, operation: str
) -> None:
    """No SDK endpoint answers "not supported" any more: each reaches its control-plane operation (the
    double answers NotFound)."""
    response = client.request(method, url, json=body, headers=AUTH)
    assert response.status_code == 404 and "not supported" not in response.text, response.text
    assert control.called(operation)


def test_billing_window_parameters_are_required(client: TestClient) -> None:
    response = client.get("/api/v1/billing/usage/events", headers=AUTH)
    assert response.status_code == 400 and response.json()["field"] == "query.starting_on"


def test_unknown_routes_and_methods_answer_json(client: TestClient) -> None:
    missing = client.get("/api/v1/nope", headers=AUTH)
    assert missing.status_code == 404 and "GET /api/v1/nope" in missing.json()["detail"]
    wrong = client.get("/api/v1/create_session", headers=AUTH)
    assert wrong.status_code == 405 and "GET" in wrong.json()["detail"]


def test_every_error_has_a_body(client: TestClient) -> None:
    for response in (
        client.post("/api/v1/get_info", content=b"", headers=AUTH),
        client.post("/api/v1/retrieve_future", json={"request_id": ""}, headers=AUTH),
        client.post("/api/v1/forward_backward", content=b"", headers=PROTO),
    ):
        assert response.status_code == 400 and response.content and response.json()["field"]


# -- middleware ------------------------------------------------------------------------------------


def test_request_ids_are_echoed_or_minted(client: TestClient) -> None:
    assert client.get("/api/v1/healthz", headers={"X-Request-Id": "abc-1"}).headers["x-request-id"] == "abc-1"
    minted = client.get("/api/v1/healthz", headers={"X-Request-Id": "bad id\n"}).headers["x-request-id"]
    assert len(minted) == 32


def test_minted_request_ids_are_unique_without_a_random_read_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """A system call per request releases the GIL, and under load the event loop waits to get it back."""
    from gateway.middleware import RequestIds

    first, second = RequestIds(), RequestIds()  # two gateways, or two processes
    monkeypatch.setattr("os.urandom", lambda n: pytest.fail("a random read per request"))
    ids = [first.mint() for _ in range(1000)] + [second.mint() for _ in range(1000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_metrics_count_by_route_template(client: TestClient) -> None:
    client.get("/api/v1/samplers/a:sample:0", headers=AUTH)
    client.get("/api/v1/samplers/b:sample:1", headers=AUTH)
    text = client.get("/metrics").text
    assert ('carpool_http_requests_total{method="GET",route="/api/v1/samplers/{sampler_id:path}",'
            'status="404"} 2.0') in text
    assert "carpool_http_request_duration_seconds_bucket" in text


# -- settings and OpenAPI --------------------------------------------------------------------------


def test_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARPOOL_LONG_POLL_SECONDS", "12")
    monkeypatch.setenv("CARPOOL_PUBLIC_BASE_URL", "https://carpool.example")
    settings = GatewaySettings()
    assert settings.long_poll_seconds == 12 and settings.public_base_url == "https://carpool.example"
    assert all(f.description for f in GatewaySettings.model_fields.values())


def test_settings_reject_unsafe_values() -> None:
    with pytest.raises(ValueError, match="long_poll_seconds"):
        GatewaySettings(long_poll_seconds=44)
    with pytest.raises(ValueError, match="half"):
        GatewaySettings(max_body_bytes=1 << 20)
    settings = GatewaySettings()
    assert settings.sdk_version_is_old("0.25.1") and not settings.sdk_version_is_old("0.38.0")
    assert not settings.sdk_version_is_old(None) and not settings.sdk_version_is_old("dev")
    # Unicode digits that are not ASCII: unknown versions, not a ValueError (a 500 on POST /v1/sessions).
    assert not settings.sdk_version_is_old("²") and not settings.sdk_version_is_old("١.٣٨")


def test_fastapi_opentelemetry_spans_only_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a configured OpenTelemetry provider, FastAPI's native telemetry records each request only when
    `otel_telemetry` says so (off by default: it costs every request a look at the global providers)."""
    if "telemetry" not in inspect.signature(FastAPI).parameters:
        pytest.skip("this FastAPI has no native telemetry")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)  # the global one is set once per process
    spans = {}
    for on in (False, True):
        with make_client(otel_telemetry=on) as c:
            assert c.get("/api/v1/healthz").status_code == 200
        spans[on] = len(exporter.get_finished_spans())
        exporter.clear()
    assert spans[False] == 0 and spans[True] > 0


def test_openapi_documents_hand_parsed_bodies(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    content = schema["paths"]["/api/v1/forward_backward"]["post"]["requestBody"]["content"]
    assert set(content) == {"application/x-protobuf", "application/json"}
    ref = schema["paths"]["/v1/sample"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.rsplit("/", 1)[1] in schema["components"]["schemas"]
    json.dumps(schema)  # serializable
    assert client.get("/docs").status_code == 200


@pytest.mark.parametrize("poller", [True, False])
def test_the_batched_sampling_poller_is_advertised_as_configured(poller: bool) -> None:
    with make_client(sample_batch_poller=poller) as client:
        config = client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers=AUTH).json()
    assert config["sample_use_retrieve_futures"] is poller
    assert config["sample_join_sampling_session"] is True
