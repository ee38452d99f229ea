"""The whole tinker SDK 0.38 surface against `carpool serve` (issue 14).

The acceptance walk lists every public method of `ServiceClient`, `TrainingClient`, `SamplingClient`,
`RestClient` and `AdminClient` by introspection and calls each one through `CALLS`; a method the table does
not know (a new SDK release) fails the walk, and so does any call that raises (a "not supported" 404
included). The server runs with JWT mode on, so every call here goes through `auth/token` JWTs, the batched
sampling poller, joined (unpickled) sampling clients and server-side custom losses: what `client/config`
advertises. Security checks follow: custom-loss graphs outside the allow-list or limits, cross-tenant
`copy_weights`, JWT expiry and revocation.
"""

from __future__ import annotations

import asyncio
import inspect
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
import torch
from tinker import types
from tinker.lib.public_interfaces.admin_client import AdminClient

from tests.e2e.server import Server, start_server

CLASSES = {"ServiceClient": tinker.ServiceClient, "TrainingClient": tinker.TrainingClient,
           "SamplingClient": tinker.SamplingClient, "RestClient": tinker.RestClient, "AdminClient": AdminClient}
PROJECT = "proj-e2e"


@pytest.fixture(scope="module")
def base_model(e2e_model_dir: Path) -> str:
    """Served under its directory's path: `SamplingClient.get_tokenizer()` loads the tokenizer by the base
    model's name (from the hub for a real model), which then resolves offline."""
    return str(e2e_model_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, e2e_model_dir: Path, base_model: str) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("carpool-surface"), base_model_spec=f"{base_model}={e2e_model_dir}",
                       extra_env={"CARPOOL_JWT_AUTH_ENABLED": "true"})
    try:
        yield srv
    finally:
        srv.stop()


def neg_ll(logprobs: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = -(logprobs * weights).sum() + 0.1 * torch.exp(logprobs).clamp(0.0, 0.5).sum()
    return loss, {"custom/neg_ll:sum": loss, "custom/tokens:mean": weights.sum()}


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


@dataclass
class World:
    """Clients and artefacts the calls share, built once (the walk's setup)."""

    server: Server
    base_model: str
    key: str
    service: tinker.ServiceClient
    training: tinker.TrainingClient
    sampler: tinker.SamplingClient
    rest: tinker.RestClient
    admin: AdminClient
    data: list[types.Datum]
    state_path: str
    sampler_path: str
    external_path: str
    loss: Any
    seen: dict[str, set[str]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def world(server: Server, base_model: str) -> Iterator[World]:
    key = server.create_tenant("surface")
    service = tinker.ServiceClient(base_url=server.url, api_key=key, project_id=PROJECT)
    training = service.create_lora_training_client(base_model=base_model, rank=4, seed=3).result()
    data = [_datum([5, 17, 42, 99, 7, 3]), _datum([8, 9, 10, 11])]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    state = training.save_state("walk-state").result().path
    sampler_path = training.save_weights_for_sampler("walk-sampler").result().path
    external = training.save_weights_external("walk-export").result().path
    sampler = service.create_sampling_client(model_path=sampler_path).result()
    loss = service.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result()
    rest = tinker.RestClient(base_url=server.url, api_key=key)  # the SDK's way since create_rest_client's deprecation
    admin = AdminClient(base_url=server.url, api_key=key)
    yield World(server, base_model, key, service, training, sampler, rest, admin, data, state, sampler_path,
                external, loss)
    service.close("success").result()
    # REST clients have no close of their own: they share the SDK's process-wide session-less holder for this
    # URL and key, whose JWT refresh would otherwise retry against the stopped server for the rest of the run.
    # (A holder's close is idempotent, so closing it through each client is fine.)
    for client in (rest, admin):
        client.holder.close()


# -- the calls ------------------------------------------------------------------------------------------------
# Each entry: (class, method) -> a function of the World returning a value; futures are resolved.
PROMPT = types.ModelInput.from_ints([5, 17, 42])
GREEDY = types.SamplingParams(max_tokens=3, temperature=0.0)


def _now_hour() -> tuple[datetime, datetime]:
    end = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    return end - timedelta(hours=3), end - timedelta(hours=1)


Call = Callable[[Callable[..., Any]], Any]
"""How to call a method: given the bound method (the sync one or its `*_async` twin), call it with arguments."""


def _service(w: World) -> tuple[Any, dict[str, Call]]:
    return w.service, {
        "copy_weights": lambda m: m(w.state_path),
        "create_custom_loss": lambda m: m(lambda logprobs: ((-logprobs).sum(), {}), {"logprobs": 1}),
        "create_lora_training_client": lambda m: m(base_model=w.base_model, rank=2),
        "create_rest_client": lambda m: m(),
        "create_sampling_client": lambda m: m(base_model=w.base_model),
        "create_training_client_from_state": lambda m: m(w.state_path),
        "create_training_client_from_state_with_optimizer": lambda m: m(w.state_path),
        "get_console_url": lambda m: m(),
        "get_server_capabilities": lambda m: m(),
        "get_telemetry": lambda m: m(),
        "close": lambda m: None,  # the world's teardown closes it (a close here would end the walk)
    }


def _training(w: World) -> tuple[Any, dict[str, Call]]:
    n = iter(range(1000))
    return w.training, {
        "create_sampling_client": lambda m: m(w.sampler_path),
        "forward": lambda m: m(w.data, "cross_entropy"),
        "forward_backward": lambda m: m(w.data, "cross_entropy"),
        "forward_backward_custom": lambda m: m(w.data, w.loss),
        "get_console_url": lambda m: m(),
        "get_info": lambda m: m(),
        "get_telemetry": lambda m: m(),
        "get_tokenizer": lambda m: m(),
        "load_state": lambda m: m(w.state_path),
        "load_state_with_optimizer": lambda m: m(w.state_path),
        "optim_step": lambda m: m(types.AdamParams(learning_rate=1e-4)),
        "save_state": lambda m: m(f"walk-{next(n)}"),
        "save_weights_and_get_sampling_client": lambda m: m(),
        "save_weights_external": lambda m: m(f"ext-{next(n)}"),
        "save_weights_for_sampler": lambda m: m(f"smp-{next(n)}"),
    }


def _sampling(w: World) -> tuple[Any, dict[str, Call]]:
    from tinker.lib.queue_state_logger import QueueState

    s = w.sampler
    return s, {
        "compute_logprobs": lambda m: m(PROMPT),
        "create": lambda m: m(s.holder, model_path=w.sampler_path),
        # A client from a handle is a "shadow": it joins the sampling session (join_sampling_session).
        "from_sampler_handle": lambda m: _sample_once_and_close(m(s.get_sampler_handle(), api_key=w.key)),
        "get_base_model": lambda m: m(),
        "get_sampler_handle": lambda m: m(),
        "get_telemetry": lambda m: m(),
        "get_tokenizer": lambda m: m(),
        "on_queue_state_change": lambda m: m(QueueState.ACTIVE, None),
        "sample": lambda m: m(PROMPT, 2, GREEDY),
    }


def _sample_once_and_close(joined: tinker.SamplingClient) -> types.SampleResponse:
    """A joined client runs over the SDK's shadow holder for its session, which nothing else closes: left open,
    its JWT refresh would retry against this module's stopped server for the rest of the run."""
    try:
        return joined.sample(PROMPT, 1, GREEDY).result()
    finally:
        joined.holder.close()


def _rest(w: World) -> tuple[Any, dict[str, Call]]:
    run = w.training.model_id
    session = w.service.holder.get_session_id()
    start, end = _now_hour()
    return w.rest, {
        "assign_session_project": lambda m: m(session, PROJECT),
        "copy_weights": lambda m: m(w.sampler_path, PROJECT),
        "delete_checkpoint": lambda m: m(run, _fresh_checkpoint(w)),
        "delete_checkpoint_from_tinker_path": lambda m: m(f"tinker://{run}/{_fresh_checkpoint(w)}"),
        "export_session_trace": lambda m: _then(m(session), _fetch_trace),
        "get_audit_log": lambda m: m(),
        "get_billing_usage": lambda m: m(start, end),
        "get_current_checkpoint_storage_usage": lambda m: m(),
        "get_external_weights_urls": lambda m: m(w.external_path),
        "get_sampler": lambda m: m(f"{session}:sample:0"),
        "get_server_capabilities": lambda m: m(),
        "get_session": lambda m: m(session),
        "get_telemetry": lambda m: m(),
        "get_training_run": lambda m: m(run),
        "get_training_run_by_tinker_path": lambda m: m(w.state_path),
        "get_weights_info_by_tinker_path": lambda m: m(w.state_path),
        "list_checkpoints": lambda m: m(run),
        "list_sessions": lambda m: m(),
        "list_training_runs": lambda m: m(),
        "list_user_checkpoints": lambda m: m(),
        "publish_checkpoint_from_tinker_path": lambda m: m(w.sampler_path),
        "search_sessions": lambda m: m(types.SessionSearchRequest(project_ids=[PROJECT])),
        "set_checkpoint_ttl_from_tinker_path": lambda m: m(w.state_path, 7200),
        "unpublish_checkpoint_from_tinker_path": lambda m: m(w.sampler_path),
        "whoami": lambda m: m(),
    }


def _admin(w: World) -> tuple[Any, dict[str, Call]]:
    start, end = _now_hour()
    return w.admin, {"get_audit_log": lambda m: m(day=date.today()),
                     "get_billing_usage": lambda m: m(start, end),
                     "get_current_checkpoint_storage_usage": lambda m: m(PROJECT),
                     "get_telemetry": lambda m: m()}


def _fresh_checkpoint(w: World) -> str:
    return w.training.save_weights_for_sampler(f"del-{datetime.now().timestamp()}").result().path.split("/", 3)[3]


def _fetch_trace(url: str) -> dict[str, Any]:
    trace = httpx.get(url, timeout=30).raise_for_status().json()  # no API key: the link is the credential
    assert any(e.get("cat") == "running" for e in trace["traceEvents"]), trace
    return trace


def _then(value: Any, check: Callable[[Any], Any]) -> Any:
    """`check` the resolved value of a sync call, or of its `*_async` twin's coroutine once awaited."""
    if inspect.isawaitable(value):
        async def awaited() -> Any:
            return check(await value)

        return awaited()
    return check(_resolve(value))


def _resolve(value: Any) -> Any:
    if hasattr(value, "result") and callable(value.result):
        return value.result()
    return value


def _public_methods(cls: type) -> list[str]:
    return sorted(n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v))


def test_client_config_advertises_what_is_served(server: Server, world: World) -> None:
    config = httpx.post(f"{server.url}/api/v1/client/config", json={"sdk_version": "0.38.0"},
                        headers={"X-API-Key": world.key}).json()
    for flag in ("sample_use_retrieve_futures", "sample_join_sampling_session", "custom_loss_server_side",
                 "pjwt_auth_enabled"):
        assert config[flag] is True, flag


def test_every_public_sdk_method_is_served(world: World) -> None:
    tables = {"ServiceClient": _service(world), "TrainingClient": _training(world),
              "SamplingClient": _sampling(world), "RestClient": _rest(world), "AdminClient": _admin(world)}
    missing, failed = [], []
    for class_name, cls in CLASSES.items():
        target, table = tables[class_name]
        for name in _public_methods(cls):
            call = table.get(name.removesuffix("_async"))
            if call is None:
                missing.append(f"{class_name}.{name}")
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    value = call(getattr(target, name))
                    _resolve(asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value)
            except Exception as exc:  # noqa: BLE001 - collect every failure, report them together
                failed.append(f"{class_name}.{name}: {type(exc).__name__}: {exc}")
    assert not missing, f"SDK methods this walk does not cover (new in the SDK?): {missing}"
    assert not failed, "\n".join(failed)


async def _awaited(value: Any) -> Any:
    return await value


def test_the_walk_used_the_advertised_paths(server: Server, world: World) -> None:
    """JWT mode, the batched poller, joined clients and server-side losses carried the walk's calls."""
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    for route in ("/api/v1/auth/token", "/api/v1/retrieve_futures", "/api/v1/join_sampling_session",
                  "/api/v1/create_custom_loss", "/api/v1/copy_weights", "/api/v1/sessions/search"):
        hits = [line for line in metrics.splitlines()
                if line.startswith("carpool_http_requests_total") and f'route="{route}"' in line
                and 'status="200"' in line]
        assert hits, f"{route} never answered 200"


# -- server-side custom loss == client-side ----------------------------------------------------------------
def test_server_side_custom_loss_equals_client_side(world: World) -> None:
    from tinker.lib.public_interfaces.custom_loss import trace_loss

    session = world.service.holder.get_session_id()
    client_side = trace_loss(neg_ll, {"logprobs": 1, "weights": 1}, session)
    assert world.loss.loss_id is not None and client_side.loss_id is None
    a = world.service.create_lora_training_client(base_model=world.base_model, rank=4, seed=99).result()
    b = world.service.create_lora_training_client(base_model=world.base_model, rank=4, seed=99).result()
    server_out = a.forward_backward_custom(world.data, world.loss).result()
    client_out = b.forward_backward_custom(world.data, client_side).result()
    for key in ("loss:sum", "custom/neg_ll:sum", "custom/tokens:mean"):
        assert server_out.metrics[key] == pytest.approx(client_out.metrics[key], rel=1e-5, abs=1e-6), key
    for x, y in zip(server_out.loss_fn_outputs, client_out.loss_fn_outputs, strict=True):
        torch.testing.assert_close(x["logprobs"].to_torch(), y["logprobs"].to_torch(), rtol=1e-5, atol=1e-6)
    # Same gradient: one identical step leaves both models computing the same logprobs.
    for client in (a, b):
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after_a, after_b = (c.forward(world.data, "cross_entropy").result() for c in (a, b))
    for x, y in zip(after_a.loss_fn_outputs, after_b.loss_fn_outputs, strict=True):
        torch.testing.assert_close(x["logprobs"].to_torch(), y["logprobs"].to_torch(), rtol=1e-4, atol=1e-5)


# -- security ---------------------------------------------------------------------------------------------
def _loss_body(session: str, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"session_id": session, "custom_loss_seq_id": 1000 + len(nodes), "name": "evil",
            "inputs": [{"name": "logprobs", "rank": 1}], "graph": {"format": 1, "nodes": nodes}}


def _node(name: str, target: str, ref: str) -> dict[str, Any]:
    return {"op": "call_function", "name": name, "target": target, "args": [{"ref": ref}], "kwargs": {}}


def test_custom_loss_graphs_outside_the_allow_list_or_limits_are_refused(server: Server, world: World) -> None:
    session = world.service.holder.get_session_id()
    head = {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}}

    def tail(ref: str) -> dict[str, Any]:
        return {"op": "output", "name": "output", "target": "output",
                "args": [{"tuple": [{"ref": ref}, {"dict": {}}]}], "kwargs": {}}

    evil = [head, _node("x", "os.system", "logprobs"), tail("x")]
    long = [head, *(_node(f"n{i}", "torch.exp", f"n{i - 1}" if i else "logprobs") for i in range(300)),
            tail("n299")]
    for nodes, reason in ((evil, "'os.system' is not allowed"), (long, "exceed the limit of 256")):
        answer = httpx.post(f"{server.url}/api/v1/create_custom_loss", json=_loss_body(session, nodes),
                            headers={"X-API-Key": world.key}, timeout=30)
        assert answer.status_code == 400, answer.text
        assert reason in answer.json()["detail"], answer.json()


def test_cross_tenant_copy_weights_needs_the_owners_token(server: Server, world: World) -> None:
    owner_key = server.create_tenant("owner")
    owner = tinker.ServiceClient(base_url=server.url, api_key=owner_key)
    try:
        run = owner.create_lora_training_client(base_model=world.base_model, rank=2).result()
        path = run.save_state("private").result().path
        body = {"source_path": path, "destination_project_id": PROJECT}
        headers = {"X-API-Key": world.key}
        refused = httpx.post(f"{server.url}/api/v1/copy_weights", json=body, headers=headers, timeout=30)
        assert refused.status_code == 404 and "weights_access_token" in refused.json()["detail"], refused.text
        bogus = httpx.post(f"{server.url}/api/v1/copy_weights", json={**body, "weights_access_token": "tml-bogus"},
                           headers=headers, timeout=30)
        assert bogus.status_code == 403 and bogus.json()["field"] == "weights_access_token", bogus.text
        copied = world.rest.copy_weights(path, PROJECT, weights_access_token=owner_key).result()
        assert copied != path and copied.endswith("/weights/private")
        restored = world.service.create_training_client_from_state(copied).result()
        assert restored.get_info().model_data.model_name == world.base_model
    finally:
        owner.close("success").result()


def test_jwts_work_like_their_key_and_die_with_it(server: Server) -> None:
    key = server.create_tenant("jwt-user")
    url = f"{server.url}/api/v1"
    token = httpx.post(f"{url}/auth/token", headers={"X-API-Key": key}, timeout=10).json()["jwt"]
    assert httpx.get(f"{url}/sessions", headers={"X-API-Key": token}, timeout=10).status_code == 200
    again = httpx.post(f"{url}/auth/token", headers={"X-API-Key": token}, timeout=10)
    assert again.status_code == 401  # a JWT cannot mint its own successor
    assert httpx.delete(f"{url}/auth/apikey/me", headers={"X-API-Key": key}, timeout=10).json()["revoked"]
    answer = _eventually_refused(f"{url}/sessions", token)
    assert answer.status_code == 401
    assert 'error="invalid_token"' in answer.headers["www-authenticate"]


def _eventually_refused(url: str, token: str) -> httpx.Response:
    """Other gateway processes may hold a validated key for the auth cache's few seconds: poll until refused."""
    deadline = datetime.now(UTC) + timedelta(seconds=30)
    while True:
        answer = httpx.get(url, headers={"X-API-Key": token}, timeout=10)
        if answer.status_code != 200 or datetime.now(UTC) > deadline:
            return answer
        asyncio.run(asyncio.sleep(0.25))


def test_retrieve_futures_reports_each_completion_once_and_keeps_the_cursor(server: Server, world: World) -> None:
    url, headers = f"{server.url}/api/v1", {"X-API-Key": world.key}
    session = world.service.holder.get_session_id()
    sampler = httpx.post(f"{url}/create_sampling_session", headers=headers, timeout=30, json={
        "session_id": session, "sampling_session_seq_id": 77, "base_model": world.base_model}).json()
    sid = sampler["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 17, 42]}]}
    submitted = {httpx.post(f"{url}/asample", headers=headers, timeout=30, json={
        "sampling_session_id": sid, "seq_id": i, "num_samples": 1, "prompt": prompt,
        "sampling_params": {"max_tokens": 2}}).json()["request_id"] for i in range(6)}
    seen: list[str] = []
    cursor = 0
    while set(seen) != submitted:
        page = httpx.post(f"{url}/retrieve_futures", headers=headers, timeout=60, json={
            "target": {"type": "sampling_session", "sampling_session_id": sid}, "prev_cursor": cursor}).json()
        assert page["cursor"] >= cursor
        cursor = page["cursor"]
        seen += [c["request_id"] for c in page["completions"]]
    assert sorted(seen) == sorted(submitted)  # each once
    idle = httpx.post(f"{url}/retrieve_futures", headers=headers, timeout=30, json={
        "target": {"type": "sampling_session", "sampling_session_id": sid}, "prev_cursor": cursor, "timeout": 0})
    assert idle.json() == {"completions": [], "cursor": cursor}
    other = httpx.post(f"{url}/retrieve_futures", headers={"X-API-Key": server.create_tenant("peeker")},
                       timeout=30, json={"target": {"type": "sampling_session", "sampling_session_id": sid},
                                         "timeout": 0})
    assert other.status_code == 404


def test_stable_reinforce_reads_the_recorded_sampler_logprobs(world: World) -> None:
    from tinker.types.provenance_spans import PromptProvenanceSpan, SampledProvenanceSpan

    fresh = world.service.create_lora_training_client(base_model=world.base_model, rank=4, seed=5).result()
    prompt = [5, 17, 42]
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=1)

    def datum(sampler: tinker.SamplingClient) -> tuple[types.Datum, list[float]]:
        seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
        tokens = [*prompt, *seq.tokens]
        n_prompt = len(prompt) - 1
        base = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:], "advantages": [0.0] * n_prompt + [1.0] * len(seq.tokens)})
        spans = [PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=n_prompt),
                 SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens))]
        model_spans = [PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                       SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1)]
        return base.with_provenance(model_input=model_spans, loss_fn_inputs=spans), list(seq.logprobs or [])

    recorded = world.service.create_sampling_client(base_model=world.base_model, record_stability_info=True).result()
    data, q = datum(recorded)
    out = fresh.forward_backward([data], "stable_reinforce").result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_torch()[len(prompt) - 1:].double()
    q_t = torch.tensor(q, dtype=torch.float64)
    expected = float(-(torch.exp(lp - q_t).clamp(max=2.0) * lp).sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    unrecorded = world.service.create_sampling_client(base_model=world.base_model).result()
    data, _ = datum(unrecorded)
    with pytest.raises(Exception, match="record_stability_info"):
        fresh.forward_backward([data], "stable_reinforce").result()


def test_unload_model_frees_the_adapter_after_its_queued_requests(server: Server, world: World) -> None:
    """Not an SDK 0.38 method (its type exists): served as a future, ordered after the model's requests."""
    client = world.service.create_lora_training_client(base_model=world.base_model, rank=2).result()
    pending = client.forward_backward(world.data, "cross_entropy")
    url, headers = f"{server.url}/api/v1", {"X-API-Key": world.key}
    future = httpx.post(f"{url}/unload_model", headers=headers, timeout=30,
                        json={"model_id": client.model_id, "type": "unload_model"}).json()
    assert pending.result().metrics["loss:sum"] > 0  # queued before the unload: it ran
    answer = {"type": "try_again"}
    while answer.get("type") == "try_again":
        answer = httpx.post(f"{url}/retrieve_future", headers=headers, timeout=60,
                            json={"request_id": future["request_id"]}).json()
    assert answer == {"model_id": client.model_id, "type": "unload_model"}
    run = world.rest.get_training_run(client.model_id).result()
    assert run.training_run_id == client.model_id
    # The unload took the model's next seq id: the SDK's next request finds it used (a 400, never a hang).
    with pytest.raises(Exception, match="unload_model"):
        client.forward(world.data, "cross_entropy").result()
