"""Security end to end, over HTTP against a real `carpool serve`: authentication, tenant isolation, key hygiene.

- Authentication: a request without a key, with an unknown or malformed key, or with a key revoked through
  `carpool keys revoke PREFIX` is answered 401 with a JSON body (the SDK's `AuthenticationError`).
- Isolation: tenant B naming anything of tenant A's — session, model, sampler, request id, checkpoint,
  training run — gets the very 404 an id that does not exist gets, on every endpoint that takes the id
  (Tinker API, REST, SDK). A published checkpoint is readable by B by design; its owner-only operations
  (delete, publish state, TTL) stay 404. B's attempts neither consume A's seq ids nor change A's state.
- Key hygiene: after everything (keys also sent inside URLs, bodies and telemetry), no tenant key appears in
  the server's output; the admin key only in the one-time bootstrap banner (the server prints it to
  stdout once, by design; `tests/e2e/server.py` reads it from there).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import tinker
from tinker import types
from tinker.lib.public_interfaces.training_client import TrainingClient
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.e2e.server import Server, start_server
from tests.sdk_janitor import close_all

PROTOBUF = "application/x-protobuf"
AUTH_CACHE_S = 5.0
"""`GatewaySettings.auth_cache_seconds` default: how long a revoked key may keep working."""
TOKENS = [1, 5, 9, 13, 17, 21]


# -- helpers ------------------------------------------------------------------------------------------
def api(server: Server, key: str | None) -> httpx.Client:
    """A raw HTTP client for `server`, sending `key` as the SDK does (`X-API-Key`)."""
    headers = {"X-API-Key": key} if key is not None else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=30)


def datum(tokens: list[int] = TOKENS) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def fwdbwd_body(model_id: str, seq_id: int, loss_fn: str = "cross_entropy") -> bytes:
    """A protobuf forward_backward body, built with the SDK's own encoder."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum()], loss_fn=loss_fn),  # type: ignore[arg-type]
        model_id=model_id,
        seq_id=seq_id,
    )
    return bytes(forward_backward_request_to_proto(request).SerializeToString())


def assert_json_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.request.method, response.request.url, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body, dict) and body.get("detail"), body
    return body


def assert_not_found(response: httpx.Response, *fragments: str) -> dict[str, Any]:
    """A JSON 404 that names what was asked for (and nothing about who owns it)."""
    body = assert_json_error(response, 404)
    for fragment in fragments:
        assert fragment in body["detail"], body
    return body


def split_path(tinker_path: str) -> tuple[str, str]:
    """`tinker://RUN/segment/name` → (RUN, `segment/name`), as the REST routes take them."""
    run_id, segment, name = tinker_path.removeprefix("tinker://").split("/")
    return run_id, f"{segment}/{name}"


def checkpoint_url(tinker_path: str, suffix: str = "") -> str:
    run_id, checkpoint_id = split_path(tinker_path)
    return f"/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}{suffix}"


def wait_result(client: httpx.Client, request_id: str, *, protobuf: bool = False) -> httpx.Response:
    """Poll `retrieve_future` until the request is no longer pending."""
    headers = {"Accept": PROTOBUF} if protobuf else {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id, "allow_metadata_only": True},
                             headers=headers)
        answer.raise_for_status()
        if answer.headers["content-type"].startswith(PROTOBUF) or answer.json().get("type") != "try_again":
            return answer
    raise AssertionError(f"request {request_id} did not finish")


def train_step(training: TrainingClient) -> float:
    loss = training.forward_backward([datum()], "cross_entropy").result().metrics["loss:sum"]
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return float(loss)


# -- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, e2e_model_dir: Path, e2e_mode: str) -> Iterator[Server]:
    """This module's server (one per mode). It sends hundreds of bad keys from one address on purpose, so
    the edge's failed-authentication limit is lifted here (that limit has tests of its own). The access log
    is on (off by default): it logs every URL, the likeliest place for a key to leak, and the log-flush
    marker is its line."""
    srv = start_server(tmp_path_factory.mktemp(f"carpool-security-{e2e_mode}"), e2e_model_dir, mode=e2e_mode,
                       extra_env={"CARPOOL_EDGE_FAILED_AUTH_PER_MINUTE": "1000000",
                                  "CARPOOL_EDGE_FAILED_AUTH_BURST": "1000000", "CARPOOL_ACCESS_LOG": "1"})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def issued_keys() -> list[str]:
    """Every tenant key this module handed out; none may reach the log (checked by `log_scanned_at_the_end`
    after the server stopped, whatever order the tests ran in)."""
    return []


@pytest.fixture(scope="module", autouse=True)
def log_scanned_at_the_end(server: Server, issued_keys: list[str]) -> Iterator[None]:
    """After the module's last test: stop the server (its exit flushes every stream) and scan the whole log
    for every key any test issued. `test_keys_never_reach_the_log` checks its own provocations at once."""
    yield
    server.stop()
    assert_no_key_in_log(server.log(), issued_keys, server.admin_key)


def assert_no_key_in_log(log: str, tenant_keys: list[str], admin_key: str) -> None:
    assert "Traceback" not in log, log[-4000:]
    for key in tenant_keys:
        assert key not in log, f"tenant key {key[:12]}... appears in the server log"
    # The admin key is printed exactly once, on purpose: the bootstrap banner (stdout, not a log record).
    banner = log.splitlines()
    at = [i for i, line in enumerate(banner) if admin_key in line]
    assert len(at) == 1 and banner[at[0]].strip() == admin_key, "admin key outside its banner"
    assert "admin tenant" in banner[at[0] - 1]


def flushed_log(server: Server, key: str) -> str:
    """The server's output once everything before this call is in it: a request for a marker path, whose
    access-log line comes after those of all requests answered before it, is waited for explicitly."""
    marker = f"log-flush-marker-{uuid.uuid4().hex}"
    with api(server, key) as client:
        client.get(f"/api/v1/training_runs/{marker}")
    deadline = time.monotonic() + 60
    while marker not in (log := server.log()):
        assert time.monotonic() < deadline, "the marker request never reached the server log"
        time.sleep(0.05)
    return log


@dataclass
class TenantA:
    """Tenant A's resources, which tenant B then tries to reach."""

    key: str
    service: tinker.ServiceClient
    training: TrainingClient
    model_id: str
    session_id: str
    """The SDK's session (the one owning `model_id`)."""
    raw_session_id: str
    """A session A made over raw HTTP, owning `sampler_id`."""
    state_path: str
    sampler_path: str
    external_path: str
    sampler_id: str
    sample_request_id: str
    create_request_id: str
    """The create_model request of a second model (made over raw HTTP, to learn a request id)."""
    extra: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def tenant_a(server: Server, base_model: str, issued_keys: list[str]) -> Iterator[TenantA]:
    key = server.create_tenant("sec-alice")
    issued_keys.append(key)
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    training = service.create_lora_training_client(base_model=base_model, rank=4).result()
    train_step(training)  # seq 1, 2
    state_path = training.save_state("a-state").result().path  # seq 3
    sampler_path = training.save_weights_for_sampler("a-sampler").result().path  # seq 4
    external_path = training.save_weights_external("a-export").result().path  # seq 5
    model_id = training.model_id
    assert model_id is not None
    with api(server, key) as client:
        raw_session = client.post("/api/v1/create_session", json={"tags": [], "user_metadata": {},
                                                                   "sdk_version": "0.38.0"}).json()["session_id"]
        sampler_id = client.post("/api/v1/create_sampling_session", json={
            "session_id": raw_session, "sampling_session_seq_id": 0, "model_path": sampler_path,
        }).json()["sampling_session_id"]
        sample = client.post("/api/v1/asample", json={
            "sampling_session_id": sampler_id, "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 2, "temperature": 1.0},
        }).json()["request_id"]
        wait_result(client, sample, protobuf=True)
        created = client.post("/api/v1/create_model", json={
            "session_id": raw_session, "model_seq_id": 0, "base_model": base_model, "lora_config": {"rank": 2},
        }).json()["request_id"]
        assert "error" not in wait_result(client, created).json()
    yield TenantA(
        key=key, service=service, training=training, model_id=model_id,
        session_id=model_id.rsplit(":train:", 1)[0], raw_session_id=raw_session, state_path=state_path,
        sampler_path=sampler_path, external_path=external_path, sampler_id=sampler_id,
        sample_request_id=sample, create_request_id=created,
    )
    close_all([service])  # finishes the session: its heartbeat stops


@pytest.fixture(scope="module")
def key_b(server: Server, issued_keys: list[str]) -> str:
    key = server.create_tenant("sec-bob")
    issued_keys.append(key)
    return key


@pytest.fixture(scope="module")
def bob(server: Server, key_b: str) -> Iterator[httpx.Client]:
    with api(server, key_b) as client:
        yield client


@pytest.fixture(scope="module")
def bob_session(bob: httpx.Client) -> str:
    answer = bob.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
    answer.raise_for_status()
    return str(answer.json()["session_id"])


# -- authentication -----------------------------------------------------------------------------------
UNKEYED_REQUESTS: list[tuple[str, str, Any]] = [
    ("POST", "/api/v1/client/config", {"sdk_version": "0.38.0"}),
    ("POST", "/api/v1/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}),
    ("POST", "/api/v1/retrieve_future", {"request_id": "r-1", "allow_metadata_only": True}),
    ("GET", "/api/v1/training_runs", None),
    ("GET", "/api/v1/checkpoints", None),
    ("GET", "/v1/usage", None),
]


@pytest.mark.parametrize(("method", "path", "body"), UNKEYED_REQUESTS)
def test_no_key_is_401_with_a_json_body(server: Server, method: str, path: str, body: Any) -> None:
    with api(server, None) as client:
        answer = client.request(method, path, json=body)
    detail = assert_json_error(answer, 401)
    assert "X-API-Key" in detail["detail"] or detail.get("field") == "X-API-Key"


def test_no_key_on_a_protobuf_body_is_401(server: Server) -> None:
    with api(server, None) as client:
        answer = client.post("/api/v1/forward_backward", content=fwdbwd_body("s:train:0", 1),
                             headers={"Content-Type": PROTOBUF})
    assert_json_error(answer, 401)


@pytest.mark.parametrize("headers", [
    {"X-API-Key": "tml-" + "Z" * 43},  # well-formed, unknown
    {"X-API-Key": "tml-short"},
    {"X-API-Key": "not-a-tinker-key"},
    {"X-API-Key": "eyJhbGciOiJIUzI1NiJ9.e30.sig"},  # a JWT: exchange is off
    {"Authorization": "Bearer tml-" + "Y" * 43},
    {"Authorization": "Basic dXNlcjpwYXNz"},
], ids=["unknown", "short", "no-prefix", "jwt", "bearer-unknown", "basic"])
def test_bad_credentials_are_401(server: Server, headers: dict[str, str]) -> None:
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
        for method, path, body in UNKEYED_REQUESTS[:4]:
            assert_json_error(client.request(method, path, json=body), 401)


def test_sdk_with_an_unknown_key_raises_authentication_error(server: Server, base_model: str) -> None:
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + "Q" * 43)
    with pytest.raises(tinker.AuthenticationError) as info:
        service.create_lora_training_client(base_model=base_model, rank=4).result()
    assert "401" in str(info.value)


def test_revoked_keys_are_401_and_only_they(server: Server, base_model: str, issued_keys: list[str]) -> None:
    never_used = server.create_tenant("sec-revoked")
    used, survivor = (server.cli("keys", "create", "sec-revoked").strip().splitlines()[-1] for _ in range(2))
    issued_keys.extend([never_used, used, survivor])
    for key in (used, survivor):
        with api(server, key) as client:
            assert client.get("/api/v1/training_runs").status_code == 200  # now in the auth cache
    for key in (never_used, used):
        assert "revoked 1 key" in server.cli("keys", "revoke", key[:12])
    with api(server, never_used) as client:  # never cached: refused at once
        assert_json_error(client.get("/api/v1/training_runs"), 401)
    with api(server, used) as client:  # cached: refused once the short auth cache lapses
        deadline = time.monotonic() + AUTH_CACHE_S + 5
        while (answer := client.get("/api/v1/training_runs")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.25)
        assert_json_error(answer, 401)
        assert_json_error(client.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}}), 401)
    with api(server, survivor) as client:  # the tenant's other key is untouched
        assert client.get("/api/v1/training_runs").status_code == 200
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key=used).create_lora_training_client(
            base_model=base_model, rank=4).result()


# -- isolation: sessions and models -------------------------------------------------------------------
def test_other_tenants_session_is_not_found(server: Server, tenant_a: TenantA, bob: httpx.Client,
                                            base_model: str) -> None:
    for session in (tenant_a.session_id, tenant_a.raw_session_id):
        missing = assert_not_found(bob.post("/api/v1/session_heartbeat", json={"session_id": session}), session)
        # Indistinguishable from a session that does not exist.
        ghost = assert_not_found(bob.post("/api/v1/session_heartbeat", json={"session_id": "ghost"}))
        assert missing["detail"].replace(session, "ghost") == ghost["detail"]
        assert_not_found(bob.get(f"/api/v1/sessions/{session}"), session)
        assert_not_found(bob.post(f"/api/v1/sessions/{session}/finish",
                                  json={"reason": {"type": "success"}, "detail": None}), session)
        # B cannot put models or samplers into A's session.
        assert_not_found(bob.post("/api/v1/create_model", json={
            "session_id": session, "model_seq_id": 7, "base_model": base_model, "lora_config": {"rank": 2},
        }), session)
        assert_not_found(bob.post("/api/v1/create_sampling_session", json={
            "session_id": session, "sampling_session_seq_id": 7, "base_model": base_model,
        }), session)
        assert_not_found(bob.post("/api/v1/load_weights", json={
            "session_id": session, "model_seq_id": 8, "path": tenant_a.state_path, "optimizer": False,
        }))
    assert tenant_a.session_id not in bob.get("/api/v1/sessions").json()["sessions"]
    # A's session is unharmed by B's finish attempt.
    with api(server, tenant_a.key) as alice:
        assert alice.post("/api/v1/session_heartbeat", json={"session_id": tenant_a.session_id}).status_code == 200


def test_other_tenants_model_is_not_found(server: Server, tenant_a: TenantA, bob: httpx.Client) -> None:
    model = tenant_a.model_id
    next_seq = 6  # A's TrainingClient has sent seq 1..5; B aims at the very next one
    assert_not_found(bob.post("/api/v1/get_info", json={"model_id": model}), model)
    assert_not_found(bob.get(f"/v1/models/{model}"), model)
    assert_not_found(bob.post("/api/v1/forward_backward", content=fwdbwd_body(model, next_seq),
                              headers={"Content-Type": PROTOBUF}), model)
    assert_not_found(bob.post("/api/v1/optim_step", json={
        "model_id": model, "seq_id": next_seq, "adam_params": {"learning_rate": 1.0},
    }), model)
    assert_not_found(bob.post("/api/v1/save_weights", json={"model_id": model, "seq_id": next_seq, "path": "x"}))
    assert_not_found(bob.post("/api/v1/save_weights_for_sampler",
                              json={"model_id": model, "seq_id": next_seq, "path": "x"}))
    assert_not_found(bob.post("/api/v1/save_weights_for_sampler", json={
        "model_id": model, "seq_id": next_seq, "sampling_session_seq_id": 3, "kind": "snapshot",
    }))
    assert_not_found(bob.post("/api/v1/save_weights_external",
                              json={"model_id": model, "seq_id": next_seq, "path": "x"}))
    assert_not_found(bob.post("/api/v1/load_weights", json={
        "model_id": model, "seq_id": next_seq, "path": tenant_a.state_path, "optimizer": True,
    }))
    assert_not_found(bob.post("/api/v1/unload_model", json={"model_id": model}), model)
    # A body with an unknown loss must not consume A's seq id either. (Custom losses are looked up per model
    # since issue 14, so the answer may be the model's "not found" rather than a loss_fn error.)
    bad = bob.post("/api/v1/forward_backward", content=fwdbwd_body(model, next_seq, loss_fn="bogus"),
                   headers={"Content-Type": PROTOBUF})
    assert 400 <= bad.status_code < 500 and ("loss_fn" in bad.text or model in bad.text), bad.text
    # A's next request (seq 6) and the ones after run as if B had never tried.
    loss = train_step(tenant_a.training)
    assert loss > 0
    assert tenant_a.training.get_info().model_id == model


def test_other_tenants_training_run_is_not_found(tenant_a: TenantA, bob: httpx.Client, key_b: str,
                                                 server: Server) -> None:
    model = tenant_a.model_id
    assert_not_found(bob.get(f"/api/v1/training_runs/{model}"), model)
    assert_not_found(bob.get(f"/api/v1/training_runs/{model}", params={"access_scope": "accessible"}), model)
    assert_not_found(bob.get(f"/api/v1/training_runs/{model}/checkpoints"), model)
    assert_not_found(bob.get(f"/v1/training_runs/{model}"), model)
    listed = bob.get("/api/v1/training_runs", params={"access_scope": "accessible"}).json()["training_runs"]
    assert model not in [run["training_run_id"] for run in listed]
    assert not bob.get("/api/v1/checkpoints").json()["checkpoints"]
    rest = tinker.RestClient(base_url=server.url, api_key=key_b)
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run(model).result()
    with pytest.raises(tinker.NotFoundError):
        rest.list_checkpoints(model).result()


# -- isolation: samplers and futures ------------------------------------------------------------------
def test_other_tenants_sampler_is_not_found(tenant_a: TenantA, bob: httpx.Client, bob_session: str) -> None:
    sampler = tenant_a.sampler_id
    assert_not_found(bob.get(f"/api/v1/samplers/{sampler}"), sampler)
    assert_not_found(bob.post("/api/v1/asample", json={
        "sampling_session_id": sampler, "seq_id": 1, "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 2},
    }), sampler)
    assert_not_found(bob.post("/api/v1/join_sampling_session", json={"sampling_session_id": sampler}), sampler)
    # B cannot sample A's private weights through a session of its own either.
    for path in (tenant_a.sampler_path, tenant_a.state_path):
        assert_not_found(bob.post("/api/v1/create_sampling_session", json={
            "session_id": bob_session, "sampling_session_seq_id": 0, "model_path": path,
        }), path)


def test_other_tenants_request_id_is_not_found(tenant_a: TenantA, bob: httpx.Client) -> None:
    for request_id in (tenant_a.sample_request_id, tenant_a.create_request_id):
        for accept in ("application/json", PROTOBUF):
            assert_not_found(bob.post("/api/v1/retrieve_future", json={
                "request_id": request_id, "allow_metadata_only": True}, headers={"Accept": accept}), request_id)
        assert_not_found(bob.get(f"/v1/futures/{request_id}"), request_id)
        assert_not_found(bob.post("/api/v1/cancel_future", json={"request_id": request_id}), request_id)
        assert_not_found(bob.post(f"/v1/futures/{request_id}/cancel", json={"request_id": request_id}))


# -- isolation: checkpoints ---------------------------------------------------------------------------
def test_other_tenants_private_checkpoints_are_not_found(server: Server, tenant_a: TenantA, bob: httpx.Client,
                                                        key_b: str) -> None:
    paths = (tenant_a.state_path, tenant_a.sampler_path, tenant_a.external_path)
    for path in paths:
        assert_not_found(bob.post("/api/v1/weights_info", json={"tinker_path": path}), path)
        assert_not_found(bob.delete(checkpoint_url(path)), path)
        assert_not_found(bob.post(checkpoint_url(path, "/publish")), path)
        assert_not_found(bob.delete(checkpoint_url(path, "/publish")), path)
        assert_not_found(bob.put(checkpoint_url(path, "/ttl"), json={"ttl_seconds": 7200}), path)
        assert_not_found(bob.put(checkpoint_url(path, "/ttl"), json={"ttl_seconds": None}), path)
    assert_not_found(bob.get(checkpoint_url(tenant_a.external_path, "/external_weights_urls")),
                     tenant_a.external_path)
    # Create-via-load from A's private training checkpoint, with and without the optimizer (SDK and raw).
    service_b = tinker.ServiceClient(base_url=server.url, api_key=key_b)
    for optimizer in (False, True):
        assert_not_found(bob.post("/api/v1/load_weights", json={
            "session_id": "whatever", "model_seq_id": 0, "path": tenant_a.state_path, "optimizer": optimizer,
        }))
    with pytest.raises(tinker.NotFoundError):
        service_b.create_training_client_from_state(tenant_a.state_path).result()
    with pytest.raises(tinker.NotFoundError):
        service_b.create_training_client_from_state_with_optimizer(tenant_a.state_path).result()
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=server.url, api_key=key_b).get_weights_info_by_tinker_path(
            tenant_a.state_path).result()
    close_all([service_b])  # finishes the session: its heartbeat stops
    # Nothing of A's changed: all three checkpoints are still there, private and without expiry.
    with api(server, tenant_a.key) as alice:
        listed = {c["tinker_path"]: c for c in alice.get("/api/v1/checkpoints").json()["checkpoints"]}
    for path in paths:
        assert path in listed and listed[path]["public"] is False and listed[path].get("expires_at") is None
    # A's export still downloads.
    with api(server, tenant_a.key) as alice:
        urls = alice.get(checkpoint_url(tenant_a.external_path, "/external_weights_urls")).json()["urls"]
        assert urls and all(httpx.get(url, timeout=30).status_code == 200 for url in urls.values())


def test_published_checkpoint_is_readable_but_stays_owner_only(server: Server, tenant_a: TenantA,
                                                               bob: httpx.Client, bob_session: str) -> None:
    path = tenant_a.sampler_path
    with api(server, tenant_a.key) as alice:
        assert alice.post(checkpoint_url(path, "/publish")).status_code == 204
        try:
            # Readable by design: B sees its shape and can sample it.
            info = bob.post("/api/v1/weights_info", json={"tinker_path": path})
            assert info.status_code == 200 and info.json()["lora_rank"] == 4
            created = bob.post("/api/v1/create_sampling_session", json={
                "session_id": bob_session, "sampling_session_seq_id": 5, "model_path": path,
            })
            assert created.status_code == 200, created.text
            # ... but the owner-only operations are still "not found" for B.
            assert_not_found(bob.delete(checkpoint_url(path)), path)
            assert_not_found(bob.delete(checkpoint_url(path, "/publish")), path)
            assert_not_found(bob.put(checkpoint_url(path, "/ttl"), json={"ttl_seconds": 7200}), path)
            # The run behind it is not B's to list.
            assert_not_found(bob.get(f"/api/v1/training_runs/{tenant_a.model_id}/checkpoints"))
            published = {c["tinker_path"]: c for c in alice.get("/api/v1/checkpoints").json()["checkpoints"]}
            assert published[path]["public"] is True and published[path].get("expires_at") is None
        finally:
            assert alice.delete(checkpoint_url(path, "/publish")).status_code == 204
    # Unpublished: private again, for B exactly like before.
    assert_not_found(bob.post("/api/v1/weights_info", json={"tinker_path": path}), path)
    assert_not_found(bob.post("/api/v1/create_sampling_session", json={
        "session_id": bob_session, "sampling_session_seq_id": 6, "model_path": path,
    }), path)


# -- key hygiene (any order: what other tests leave in the log is scanned at module teardown) ------------
def test_keys_never_reach_the_log(server: Server, tenant_a: TenantA, key_b: str, issued_keys: list[str]) -> None:
    assert server.admin_key.startswith("tml-"), "the admin key was not found in the bootstrap banner"
    # Provoke the places a key could leak through: URLs (the access log), bodies echoed in errors, client
    # telemetry (logged server side), and errors with the admin's key as credential.
    for key in (tenant_a.key, key_b, server.admin_key):
        with api(server, key) as client:
            client.get(f"/api/v1/training_runs/{key}")
            client.get(f"/api/v1/samplers/{quote(key)}", params={"note": key})
            client.post("/api/v1/session_heartbeat", json={"session_id": key})
            client.post("/api/v1/retrieve_future", json={"request_id": key})
            client.post("/api/v1/optim_step", json={"model_id": key, "seq_id": 1, "adam_params": {"eps": key}})
            client.post("/api/v1/forward_backward", content=b"\x0a\xff" + key.encode(),
                        headers={"Content-Type": PROTOBUF})
            client.post("/api/v1/telemetry", json={
                "events": [{"event": "UNHANDLED_EXCEPTION", "event_id": "e1", "event_session_index": 0,
                            "severity": "ERROR", "timestamp": datetime.now(UTC).isoformat(),
                            "error_message": f"client failed with key {key}", "error_type": "ValueError"}],
                "platform": "linux", "sdk_version": "0.38.0", "session_id": key, "process_uuid": "p1",
            })
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        anonymous.get("/api/v1/training_runs", headers={"X-API-Key": key_b + "x"})  # a near-miss key
        anonymous.get("/api/v1/training_runs", headers={"Authorization": f"Basic {key_b}"})
    log = flushed_log(server, key_b)
    assert issued_keys, "no keys were issued?"
    assert_no_key_in_log(log, [*issued_keys, key_b, tenant_a.key], server.admin_key)
