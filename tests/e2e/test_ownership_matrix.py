"""The ownership matrix, generated from the app's route table: tenant B naming tenant A's ids learns nothing.

`ROUTES` holds a case for every route of the gateway (Tinker API, REST, hub), built from `gateway.app.
create_app`'s own route table: a route that takes an id has a `Case` (how B names the id in the path or the
body), every other route an `Exempt` with the reason it takes no foreign id. A route added without either
fails `test_every_route_has_a_case` — so a new endpoint cannot ship without its isolation case.

For every case, tenant B sends the request twice against a real `carpool serve`: once with A's real ids, once
with ids of the same shape that exist nowhere. Both answers must be 404 and, once the ids themselves are
masked, byte-identical: the status, the body and the headers that matter say nothing about whether the id
exists or who owns it. A's own request of the same kind must not be a 404 (so the case names a real
object), and A trains on afterwards: B's attempts consumed none of A's seq ids and changed none of A's
state. Listings (B's sessions, runs, checkpoints, pushes) never contain A's ids.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import httpx
import pytest
import tinker

from tests.e2e.server import Server
from tests.e2e.test_security import api, fwdbwd_body, split_path, train_step, wait_result
from tests.sdk_janitor import close_all

PROTOBUF = "application/x-protobuf"
HIDDEN_HEADERS = ("content-type", "retry-after")


@dataclass(frozen=True)
class Ids:
    """Everything of one tenant that another may try to name."""

    session: str
    model: str
    state_path: str
    sampler_path: str
    external_path: str
    sampler: str
    request: str
    push: str

    @property
    def run(self) -> str:
        return self.model

    def checkpoint(self, which: str = "state_path") -> tuple[str, str]:
        return split_path(getattr(self, which))

    def ghost(self) -> Ids:
        """Ids of the same shapes that name nothing."""
        swap = {self.session: f"{uuid.uuid4()}"}
        swap[self.model] = self.model.replace(self.session, swap[self.session])
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            for old in sorted(swap, key=len, reverse=True):
                value = value.replace(old, swap[old])
            out[f.name] = value
        out["sampler"] = self.sampler.replace(self.session, swap[self.session])
        out["request"] = str(uuid.uuid4()) if "-" in self.request else uuid.uuid4().hex
        out["push"] = str(int(self.push) + 10_000_000)
        return Ids(**out)

    def values(self) -> list[str]:
        return [getattr(self, f.name) for f in fields(self)]


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] | None = None


@dataclass(frozen=True)
class Case:
    """How B names A's id on one route; `owner_ok` says whether A's own call of it must succeed (not 404)."""

    build: Callable[[Ids], Call]
    owner_ok: bool = True


@dataclass(frozen=True)
class Exempt:
    reason: str


NO_ID = Exempt("takes no id of another tenant (creates, lists the caller's own, or reads server state)")
LISTING = Exempt("lists the caller's own objects: checked by test_listings_never_show_another_tenants_ids")
TOKEN = Exempt("the signed token in the path is the credential (no API key); tokens are unguessable")
NOT_SERVED = Exempt("answers 404 to every caller (not served by this server)")


def _ckpt(ids: Ids, suffix: str = "", which: str = "state_path") -> str:
    run, checkpoint = ids.checkpoint(which)
    return f"/api/v1/training_runs/{run}/checkpoints/{checkpoint}{suffix}"


def _sample(ids: Ids, **target: str) -> dict[str, Any]:
    return {"num_samples": 1, "seq_id": 7, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {"max_tokens": 1}, **target}


SEQ = 99  # far beyond A's next seq id: B's calls must not consume it either (checked: A trains on)
ROUTES: dict[tuple[str, str], Case | Exempt] = {
    ("POST", "/api/v1/retrieve_future"): Case(lambda i: Call("POST", "/api/v1/retrieve_future",
                                                             {"request_id": i.request})),
    ("POST", "/api/v1/retrieve_futures"): Case(lambda i: Call("POST", "/api/v1/retrieve_futures", {
        "target": {"type": "sampling_session", "sampling_session_id": i.sampler}, "timeout": 0})),
    ("POST", "/api/v1/cancel_future"): Case(lambda i: Call("POST", "/api/v1/cancel_future",
                                                           {"request_id": i.request})),
    ("POST", "/api/v1/create_model"): Case(lambda i: Call("POST", "/api/v1/create_model", {
        "session_id": i.session, "model_seq_id": 40, "base_model": "carpool/tiny-qwen3",
        "lora_config": {"rank": 2}})),
    ("POST", "/api/v1/get_info"): Case(lambda i: Call("POST", "/api/v1/get_info", {"model_id": i.model})),
    ("POST", "/api/v1/forward_backward"): Case(lambda i: Call(
        "POST", "/api/v1/forward_backward", content=fwdbwd_body(i.model, SEQ), headers={"Content-Type": PROTOBUF})),
    ("POST", "/api/v1/forward"): Case(lambda i: Call("POST", "/api/v1/forward", {
        "model_id": i.model, "seq_id": SEQ, "forward_input": _json_input()})),
    ("POST", "/api/v1/optim_step"): Case(lambda i: Call("POST", "/api/v1/optim_step", {
        "model_id": i.model, "seq_id": SEQ, "adam_params": {"learning_rate": 0.5}})),
    ("POST", "/api/v1/unload_model"): Case(lambda i: Call("POST", "/api/v1/unload_model", {"model_id": i.model}),
                                           owner_ok=False),
    ("POST", "/api/v1/client/config"): NO_ID,
    ("POST", "/api/v1/client/dynamic_config"): NO_ID,
    ("POST", "/api/v1/create_session"): NO_ID,
    ("POST", "/api/v1/session_heartbeat"): Case(lambda i: Call("POST", "/api/v1/session_heartbeat",
                                                               {"session_id": i.session})),
    ("POST", "/api/v1/sessions/{session_id}/finish"): Case(lambda i: Call(
        "POST", f"/api/v1/sessions/{i.session}/finish", {"reason": {"type": "success"}}), owner_ok=False),
    ("POST", "/api/v1/telemetry"): NO_ID,
    ("GET", "/api/v1/get_server_capabilities"): NO_ID,
    ("GET", "/api/v1/healthz"): NO_ID,
    ("GET", "/api/v1/auth/apikey/me"): NO_ID,
    ("DELETE", "/api/v1/auth/apikey/me"): Exempt("revokes the presented key itself"),
    ("POST", "/api/v1/auth/token"): NO_ID,
    ("GET", "/api/v1/sessions"): LISTING,
    ("GET", "/api/v1/sessions/{session_id}"): Case(lambda i: Call("GET", f"/api/v1/sessions/{i.session}")),
    ("POST", "/api/v1/save_weights"): Case(lambda i: Call("POST", "/api/v1/save_weights", {
        "model_id": i.model, "seq_id": SEQ, "path": "stolen"})),
    ("POST", "/api/v1/save_weights_for_sampler"): Case(lambda i: Call("POST", "/api/v1/save_weights_for_sampler", {
        "model_id": i.model, "seq_id": SEQ, "path": "stolen"})),
    ("POST", "/api/v1/save_weights_external"): Case(lambda i: Call("POST", "/api/v1/save_weights_external", {
        "model_id": i.model, "seq_id": SEQ, "path": "stolen"})),
    ("POST", "/api/v1/load_weights"): Case(lambda i: Call("POST", "/api/v1/load_weights", {
        "model_id": i.model, "seq_id": SEQ, "path": i.state_path, "optimizer": False})),
    ("GET", "/api/v1/training_runs"): LISTING,
    ("GET", "/api/v1/training_runs/{training_run_id}"): Case(lambda i: Call("GET", f"/api/v1/training_runs/{i.run}")),
    ("GET", "/api/v1/training_runs/{training_run_id}/checkpoints"): Case(
        lambda i: Call("GET", f"/api/v1/training_runs/{i.run}/checkpoints")),
    ("GET", "/api/v1/checkpoints"): LISTING,
    ("POST", "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/publish"): Case(
        lambda i: Call("POST", _ckpt(i, "/publish")), owner_ok=False),
    ("DELETE", "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/publish"): Case(
        lambda i: Call("DELETE", _ckpt(i, "/publish")), owner_ok=False),
    ("PUT", "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/ttl"): Case(
        lambda i: Call("PUT", _ckpt(i, "/ttl"), {"ttl_seconds": 3600}), owner_ok=False),
    ("GET", "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls"): Case(
        lambda i: Call("GET", _ckpt(i, "/external_weights_urls", "external_path"))),
    ("DELETE", "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}"): Case(
        lambda i: Call("DELETE", _ckpt(i)), owner_ok=False),
    ("POST", "/api/v1/weights_info"): Case(lambda i: Call("POST", "/api/v1/weights_info",
                                                          {"tinker_path": i.state_path})),
    ("POST", "/api/v1/copy_weights"): Case(lambda i: Call("POST", "/api/v1/copy_weights",
                                                          {"source_path": i.state_path,
                                                           "destination_project_id": "p1"}), owner_ok=False),
    ("GET", "/api/v1/download/{token:path}"): TOKEN,
    ("POST", "/api/v1/create_sampling_session"): Case(lambda i: Call("POST", "/api/v1/create_sampling_session", {
        "session_id": i.session, "sampling_session_seq_id": 40, "model_path": i.sampler_path})),
    ("GET", "/api/v1/samplers/{sampler_id:path}"): Case(lambda i: Call("GET", f"/api/v1/samplers/{i.sampler}")),
    ("POST", "/api/v1/join_sampling_session"): Case(lambda i: Call("POST", "/api/v1/join_sampling_session",
                                                                   {"sampling_session_id": i.sampler})),
    ("POST", "/api/v1/asample"): Case(lambda i: Call("POST", "/api/v1/asample",
                                                     _sample(i, sampling_session_id=i.sampler))),
    ("POST", "/api/v1/create_custom_loss"): Case(lambda i: Call("POST", "/api/v1/create_custom_loss", {
        "session_id": i.session, "custom_loss_seq_id": 40, "name": "x", "inputs": [{"name": "logprobs", "rank": 1}],
        "graph": {"nodes": [
            {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
            {"op": "output", "name": "output", "target": "output",
             "args": [{"tuple": [{"ref": "logprobs"}, {"dict": {}}]}], "kwargs": {}}]}}), owner_ok=False),
    ("PUT", "/api/v1/sessions/{session_id}/project"): Case(lambda i: Call(
        "PUT", f"/api/v1/sessions/{i.session}/project", {"project_id": "p1"}), owner_ok=False),
    ("GET", "/api/v1/sessions/{session_id}/trace_export"): Case(
        lambda i: Call("GET", f"/api/v1/sessions/{i.session}/trace_export")),
    ("GET", "/api/v1/trace/{token}"): TOKEN,
    ("POST", "/api/v1/sessions/search"): LISTING,
    ("GET", "/api/v1/audit"): Exempt("admin tenants only; lists the server's own audit log"),
    ("GET", "/api/v1/billing/usage/events"): Exempt("admin tenants only"),
    ("GET", "/api/v1/billing/usage/checkpoints/current"): Exempt("admin tenants only"),
    ("POST", "/v1/sessions"): NO_ID,
    ("POST", "/v1/models"): Case(lambda i: Call("POST", "/v1/models", {
        "session_id": i.session, "model_seq_id": 41, "base_model": "carpool/tiny-qwen3", "lora_config": {"rank": 2}})),
    ("POST", "/v1/forward_backward"): Case(lambda i: Call("POST", "/v1/forward_backward", {
        "model_id": i.model, "seq_id": SEQ, "forward_backward_input": _json_input()})),
    ("POST", "/v1/forward"): Case(lambda i: Call("POST", "/v1/forward", {
        "model_id": i.model, "seq_id": SEQ, "forward_input": _json_input()})),
    ("POST", "/v1/optim_step"): Case(lambda i: Call("POST", "/v1/optim_step", {
        "model_id": i.model, "seq_id": SEQ, "adam_params": {"learning_rate": 0.5}})),
    ("POST", "/v1/save_weights"): Case(lambda i: Call("POST", "/v1/save_weights", {
        "model_id": i.model, "seq_id": SEQ, "path": "stolen"})),
    ("POST", "/v1/save_weights_for_sampler"): Case(lambda i: Call("POST", "/v1/save_weights_for_sampler", {
        "model_id": i.model, "seq_id": SEQ, "path": "stolen"})),
    ("POST", "/v1/save_weights_external"): Case(lambda i: Call("POST", "/v1/save_weights_external", {
        "model_id": i.model, "seq_id": SEQ, "path": "stolen"})),
    ("POST", "/v1/load_weights"): Case(lambda i: Call("POST", "/v1/load_weights", {
        "model_id": i.model, "seq_id": SEQ, "path": i.state_path, "optimizer": False})),
    ("POST", "/v1/sampling_sessions"): Case(lambda i: Call("POST", "/v1/sampling_sessions", {
        "session_id": i.session, "sampling_session_seq_id": 41, "model_path": i.sampler_path})),
    ("POST", "/v1/sample"): Case(lambda i: Call("POST", "/v1/sample", _sample(i, sampling_session_id=i.sampler))),
    ("GET", "/v1/training_runs"): LISTING,
    ("GET", "/v1/training_runs/{training_run_id}"): Case(lambda i: Call("GET", f"/v1/training_runs/{i.run}")),
    ("GET", "/v1/training_runs/{training_run_id}/checkpoints"): Case(
        lambda i: Call("GET", f"/v1/training_runs/{i.run}/checkpoints")),
    ("GET", "/v1/checkpoints"): LISTING,
    ("POST", "/v1/futures/{request_id}/cancel"): Case(lambda i: Call("POST", f"/v1/futures/{i.request}/cancel")),
    ("GET", "/v1/models/{model_id}"): Case(lambda i: Call("GET", f"/v1/models/{i.model}")),
    ("GET", "/v1/futures/{request_id}"): Case(lambda i: Call("GET", f"/v1/futures/{i.request}")),
    ("GET", "/v1/usage"): Exempt("the caller's own usage"),
    ("POST", "/v1/hub_pushes"): Case(lambda i: Call("POST", "/v1/hub_pushes", {
        "tinker_path": i.state_path, "hub": "huggingface", "repo_id": "bob/stolen"})),
    ("GET", "/v1/hub_pushes"): LISTING,
    ("GET", "/v1/hub_pushes/{push_id}"): Case(lambda i: Call("GET", f"/v1/hub_pushes/{i.push}")),
    ("POST", "/v1/hub_pushes/{push_id}/retry"): Case(lambda i: Call("POST", f"/v1/hub_pushes/{i.push}/retry"),
                                                     owner_ok=False),
    ("PUT", "/v1/hub_credentials/{hub_name}"): Exempt("the caller's own credential slot, named by hub"),
    ("DELETE", "/v1/hub_credentials/{hub_name}"): Exempt("the caller's own credential slot, named by hub"),
    ("GET", "/metrics"): Exempt("server-wide series, no tenant ids"),
}


def _json_input() -> dict[str, Any]:
    return {"loss_fn": "cross_entropy", "data": [{
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64"},
                           "weights": {"data": [1.0, 1.0, 1.0], "dtype": "float32"}}}]}


def app_routes() -> set[tuple[str, str]]:
    """(method, path) of every API route the gateway serves, read from the app factory itself."""
    from fastapi.routing import APIRoute

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    def walk(routes: Any) -> Iterator[APIRoute]:
        for route in routes:
            if isinstance(route, APIRoute):
                yield route
            nested = getattr(route, "original_router", None)
            if nested is not None:
                yield from walk(nested.routes)

    app = create_app(GatewaySettings(metrics_enabled=True), object(), object())  # type: ignore[arg-type]
    return {(method, route.path) for route in walk(app.routes) for method in route.methods - {"HEAD"}}


def test_every_route_has_a_case() -> None:
    routes = app_routes()
    missing = sorted(routes - set(ROUTES))
    assert not missing, f"routes without an ownership case (add a Case or an Exempt to ROUTES): {missing}"
    stale = sorted(set(ROUTES) - routes)
    assert not stale, f"ROUTES names routes the app no longer has: {stale}"


# -- the live matrix ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def alice(server: Server, base_model: str) -> Iterator[tuple[str, Ids, Any]]:
    key = server.create_tenant("matrix-alice")
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    training = service.create_lora_training_client(base_model=base_model, rank=2).result()
    train_step(training)
    state = training.save_state("m-state").result().path
    sampler_path = training.save_weights_for_sampler("m-sampler").result().path
    external = training.save_weights_external("m-export").result().path
    model = training.model_id
    assert model is not None
    with api(server, key) as client:
        sampler = client.post("/api/v1/create_sampling_session", json={
            "session_id": model.rsplit(":train:", 1)[0], "sampling_session_seq_id": 0,
            "model_path": sampler_path}).json()["sampling_session_id"]
        request = client.post("/api/v1/asample", json=_sample_body(sampler)).json()["request_id"]
        wait_result(client, request, protobuf=True)
        assert client.put("/v1/hub_credentials/huggingface", json={"token": "hf_matrix"}).status_code == 204
        push = client.post("/v1/hub_pushes", json={"tinker_path": state, "hub": "huggingface",
                                                   "repo_id": "alice/matrix"})
        assert push.status_code == 202, push.text
    ids = Ids(session=model.rsplit(":train:", 1)[0], model=model, state_path=state, sampler_path=sampler_path,
              external_path=external, sampler=sampler, request=request, push=str(push.json()["id"]))
    yield key, ids, training
    close_all([service])  # finishes the session: its heartbeat stops


def _sample_body(sampler: str) -> dict[str, Any]:
    return {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 1, "sampling_params": {"max_tokens": 1},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}}


@pytest.fixture(scope="module")
def bob(server: Server) -> Iterator[httpx.Client]:
    with api(server, server.create_tenant("matrix-bob")) as client:
        # With a hub token of its own, B's push of A's checkpoint gets as far as the ownership check.
        assert client.put("/v1/hub_credentials/huggingface", json={"token": "hf_bob"}).status_code == 204
        yield client


CASES = sorted(((m, p) for (m, p), c in ROUTES.items() if isinstance(c, Case)), key=lambda r: (r[1], r[0]))


@pytest.mark.parametrize(("method", "path"), CASES, ids=[f"{m} {p}" for m, p in CASES])
def test_another_tenants_id_gets_the_same_404_as_an_unknown_one(
        server: Server, alice: tuple[str, Ids, Any], bob: httpx.Client, method: str, path: str) -> None:
    key, ids, _ = alice
    case = ROUTES[(method, path)]
    assert isinstance(case, Case)
    ghost = ids.ghost()
    foreign = _send(bob, case.build(ids))
    unknown = _send(bob, case.build(ghost))
    assert foreign.status_code == 404, (foreign.request.url, foreign.text)
    assert unknown.status_code == 404, (unknown.request.url, unknown.text)
    assert _masked(foreign, ids) == _masked(unknown, ghost)
    if case.owner_ok:  # the id is real: its owner is not told "not found"
        with api(server, key) as owner:
            assert _send(owner, case.build(ids)).status_code != 404


def test_listings_never_show_another_tenants_ids(alice: tuple[str, Ids, Any], bob: httpx.Client) -> None:
    _, ids, _ = alice
    pages = [bob.get(p).text for p in ("/api/v1/sessions", "/api/v1/training_runs", "/api/v1/checkpoints",
                                       "/v1/training_runs", "/v1/checkpoints", "/v1/hub_pushes")]
    pages.append(bob.post("/api/v1/sessions/search", json={}).text)
    for page in pages:
        for value in (ids.session, ids.model, ids.state_path, ids.sampler):
            assert value not in page


def test_the_owner_trains_on_untouched(alice: tuple[str, Ids, Any]) -> None:
    """B's calls at A's model (seq 99, optim_step, loads, saves) consumed none of A's seq ids."""
    _, _, training = alice
    assert train_step(training) > 0
    assert training.save_state("m-after").result().path.endswith("/weights/m-after")


def _send(client: httpx.Client, call: Call) -> httpx.Response:
    return client.request(call.method, call.path, json=call.json, content=call.content, headers=call.headers)


def _masked(response: httpx.Response, ids: Ids) -> tuple[int, str, tuple[str, ...]]:
    """The response with the ids it names replaced by placeholders, and the headers a client could read."""
    text = response.text
    for value in sorted(ids.values(), key=len, reverse=True):
        text = text.replace(value, "<id>")
        text = text.replace(value.replace(":", "%3A"), "<id>")
    text = re.sub(r'"request_id":\s*"[^"]+"', '"request_id": "<rid>"', text)
    headers = tuple(f"{h}={response.headers.get(h)}" for h in HIDDEN_HEADERS)
    return response.status_code, text, headers

