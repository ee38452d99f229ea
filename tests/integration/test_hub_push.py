"""Hub pushes end to end: REST (`/v1/hub_pushes`, `/v1/hub_credentials`) on the real gateway app, the control
plane and engine making a real checkpoint, the push runner in-process and under a real Celery worker on
Redis, and the hubs as recording fakes at the `HfApi` / `HubApi` boundary (plus the real `HfApi` against
an unreachable endpoint)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import BASE, Harness, build_harness
from starlette.testclient import TestClient

from deploy.embedded import StartupError
from deploy.hub_wiring import hub_cipher
from deploy.settings import ClusterSettings
from gateway.app import create_app
from gateway.auth import DatabaseAuthenticator
from gateway.settings import GatewaySettings
from services.auth.tenants import Tenant, create_tenant_with_key
from services.control.api import CheckpointRef, SaveOptions
from services.db import database_url_for_data_dir
from services.db.models import HubCredentialRow, HubPushRow
from services.domain.training import LoraSpec
from services.hub.clients import HubClient, HuggingFaceClient, ModelScopeClient
from services.hub.credentials import TokenCipher
from services.hub.dispatch import CeleryDispatcher, InProcessDispatcher, celery_app, register_push_task
from services.hub.runner import PushRunner
from services.hub.service import HubPushService
from tests.e2e.cluster_mode import wipe_prefix
from tests.hub_fakes import FakeHfApi, FakeHTTPError, FakeMsHubApi
from tests.required import require_redis

TOKEN = "hf_tenant_write_token_0123456789"
REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass
class Stack:
    harness: Harness
    http: TestClient
    hf: FakeHfApi
    ms: FakeMsHubApi
    runner: PushRunner
    cipher: TokenCipher

    def tenant(self, name: str) -> tuple[Tenant, dict[str, str]]:
        with self.harness.db.sessions.begin() as db:
            tenant, issued = create_tenant_with_key(db, name)
        return tenant, {"X-API-Key": issued.key}

    def checkpoint(self, tenant: Tenant, name: str = "w") -> str:
        h = self.harness
        model = h.run(h.control.create_model(tenant, h.session(tenant), 0, BASE, LoraSpec(rank=4, seed=1), None))
        save = h.run(h.control.save(tenant, model.model_id, 1, "training", SaveOptions(name=name)))
        ref = h.done(tenant, save.request_id)
        assert isinstance(ref, CheckpointRef)
        return ref.tinker_path

    def wait(self, headers: dict[str, str], push_id: int) -> dict[str, Any]:
        for _ in range(600):
            body = self.http.get(f"/v1/hub_pushes/{push_id}", headers=headers).json()
            if body["status"] in ("done", "failed"):
                return body
            time.sleep(0.05)
        raise AssertionError(f"push {push_id} did not finish: {body}")


def _runner(h: Harness, clients: dict[str, HubClient], cipher: TokenCipher, retries: int = 2) -> PushRunner:
    return PushRunner(h.db, h.store, clients, cipher, max_retries=retries, backoff_s=0.0)  # type: ignore[arg-type]


@pytest.fixture
def stack(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    h = build_harness(database_url_for_data_dir(tmp_path), tiny_model_dir, tmp_path)
    hf, ms = FakeHfApi(), FakeMsHubApi()
    cipher = TokenCipher(b"t" * 32)
    runner = _runner(h, {"hf": HuggingFaceClient(hf), "ms": ModelScopeClient(ms)}, cipher)
    dispatcher = InProcessDispatcher(runner, sleep=lambda _s: None)
    service = HubPushService(h.db, cipher, dispatcher)
    app = create_app(GatewaySettings(), h.control, DatabaseAuthenticator(h.db), hub_pushes=service)
    with TestClient(app) as http:
        yield Stack(h, http, hf, ms, runner, cipher)
    dispatcher.shutdown()
    h.close()


def _renamed(tinker_path: str, name: str) -> str:
    return tinker_path.rsplit("/", 1)[0] + "/" + name


def _push(stack: Stack, headers: dict[str, str], **body: Any) -> Any:
    return stack.http.post("/v1/hub_pushes", json=body, headers=headers)


def test_push_to_huggingface_uploads_a_loadable_adapter_and_card(stack: Stack, tiny_model_dir: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    tenant, headers = stack.tenant("acme")
    path = stack.checkpoint(tenant)
    assert stack.http.put("/v1/hub_credentials/huggingface", json={"token": TOKEN},
                          headers=headers).status_code == 204
    answer = _push(stack, headers, tinker_path=path, hub="huggingface", repo_id="acme/tiny-lora",
                   commit_message="first adapter")
    assert answer.status_code == 202 and answer.json()["status"] in ("queued", "running", "done")
    done = stack.wait(headers, answer.json()["id"])
    assert done["status"] == "done" and done["attempts"] == 1 and done["private"] is True
    repo = stack.hf.repos["acme/tiny-lora"]
    assert done["hub_revision"] == repo.branches["main"][0].commit_id and done["url"].endswith(done["hub_revision"])
    assert sorted(repo.files) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    card = repo.files["README.md"].decode()
    assert "library_name: peft" in card and f"base_model: \"{BASE}\"" in card and "| LoRA rank | 4 |" in card
    assert "| Optimizer steps | 0 |" in card and path.split("/")[2] in card

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert repo.snapshot is not None
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), repo.snapshot)
    assert peft_model.peft_config["default"].r == 4

    # The token is never returned and never logged; the database holds ciphertext only.
    listing = stack.http.get("/v1/hub_pushes?limit=10", headers=headers)
    assert TOKEN not in listing.text and listing.json()["total_count"] == 1
    assert TOKEN not in caplog.text
    with stack.harness.db.sessions.begin() as db:
        stored = db.query(HubCredentialRow).one().token_ciphertext
    assert TOKEN not in stored and stack.cipher.decrypt(stored) == TOKEN


def test_push_to_modelscope_and_pagination(stack: Stack) -> None:
    tenant, headers = stack.tenant("acme")
    path = stack.checkpoint(tenant)
    stack.http.put("/v1/hub_credentials/modelscope", json={"token": "ms-token-1"}, headers=headers)
    ids = [_push(stack, headers, tinker_path=path, hub="modelscope", repo_id=f"acme/r{i}", private=False).json()["id"]
           for i in range(3)]
    assert all(stack.wait(headers, i)["status"] == "done" for i in ids)
    assert stack.ms.repos["acme/r0"].private is False
    page = stack.http.get("/v1/hub_pushes?limit=2&offset=1", headers=headers).json()
    assert page["total_count"] == 3 and [p["id"] for p in page["hub_pushes"]] == [ids[1], ids[0]]


def test_bad_input_is_a_clear_4xx(stack: Stack) -> None:
    tenant, headers = stack.tenant("acme")
    _, other_headers = stack.tenant("other")
    path = stack.checkpoint(tenant)
    stack.http.put("/v1/hub_credentials/huggingface", json={"token": TOKEN}, headers=headers)
    cases = [
        (dict(tinker_path=path, hub="github", repo_id="acme/x"), 400, "hub"),
        (dict(tinker_path=path, hub="huggingface", repo_id="no-namespace"), 400, "repo_id"),
        (dict(tinker_path=path, hub="huggingface", repo_id="acme/bad name"), 400, "repo_id"),
        (dict(tinker_path=path, hub="huggingface", repo_id="acme/x", revision="../main"), 400, "revision"),
        (dict(tinker_path="not-a-path", hub="huggingface", repo_id="acme/x"), 400, "tinker_path"),
        (dict(tinker_path=_renamed(path, "missing"), hub="huggingface", repo_id="acme/x"), 404, "tinker_path"),
        (dict(tinker_path=path, hub="huggingface", repo_id="acme/x", extra=1), 400, "extra"),
    ]
    for body, status, field in cases:
        answer = _push(stack, headers, **body)
        assert answer.status_code == status, (body, answer.text)
        assert field in (answer.json().get("field") or "") + answer.json()["detail"], answer.text
    # Someone else's checkpoint is exactly as unknown as a missing one.
    stack.http.put("/v1/hub_credentials/huggingface", json={"token": TOKEN}, headers=other_headers)
    foreign = _push(stack, other_headers, tinker_path=path, hub="huggingface", repo_id="other/x")
    missing = _push(stack, other_headers, tinker_path=_renamed(path, "zz"), hub="huggingface",
                    repo_id="other/x")
    assert foreign.status_code == missing.status_code == 404
    assert foreign.json()["detail"].replace(path, _renamed(path, "zz")) == missing.json()["detail"]
    # A push of the caller's own checkpoint, read by someone else: 404 too.
    own = _push(stack, headers, tinker_path=path, hub="huggingface", repo_id="acme/x").json()["id"]
    assert stack.http.get(f"/v1/hub_pushes/{own}", headers=other_headers).status_code == 404
    assert stack.http.get("/v1/hub_pushes/999999", headers=headers).status_code == 404
    assert stack.http.get("/v1/hub_pushes?limit=0", headers=headers).status_code == 400
    assert stack.http.put("/v1/hub_credentials/github", json={"token": "x"}, headers=headers).status_code == 400
    assert stack.http.put("/v1/hub_credentials/modelscope", json={"token": " "}, headers=headers).status_code == 400
    assert stack.http.get("/v1/hub_pushes").status_code == 401


def test_push_without_any_credential_says_how_to_add_one(stack: Stack) -> None:
    tenant, headers = stack.tenant("acme")
    path = stack.checkpoint(tenant)
    answer = _push(stack, headers, tinker_path=path, hub="modelscope", repo_id="acme/x")
    assert answer.status_code == 400 and "PUT /v1/hub_credentials/modelscope" in answer.json()["detail"]
    stack.http.put("/v1/hub_credentials/modelscope", json={"token": "t"}, headers=headers)
    assert stack.http.delete("/v1/hub_credentials/modelscope", headers=headers).status_code == 204
    assert _push(stack, headers, tinker_path=path, hub="modelscope", repo_id="acme/x").status_code == 400
    assert stack.http.delete("/v1/hub_credentials/modelscope", headers=headers).status_code == 404


def test_transient_failures_retry_permanent_ones_do_not(stack: Stack) -> None:
    tenant, headers = stack.tenant("acme")
    path = stack.checkpoint(tenant)
    stack.http.put("/v1/hub_credentials/huggingface", json={"token": TOKEN}, headers=headers)
    stack.hf.fail_next("upload_folder", FakeHTTPError(503, "Service Unavailable"))
    stack.hf.fail_next("create_repo", ConnectionError("connection reset"))
    flaky = stack.wait(headers, _push(stack, headers, tinker_path=path, hub="huggingface",
                                      repo_id="acme/flaky").json()["id"])
    assert flaky["status"] == "done" and flaky["attempts"] == 3
    assert len(stack.hf.commits("acme/flaky")) == 1

    stack.hf.fail_next("create_repo", FakeHTTPError(401, f"Invalid credentials: {TOKEN}"))
    denied = stack.wait(headers, _push(stack, headers, tinker_path=path, hub="huggingface",
                                       repo_id="acme/denied").json()["id"])
    assert denied["status"] == "failed" and denied["attempts"] == 1
    assert "HTTP 401 (the token is invalid)" in denied["error"] and TOKEN not in denied["error"]

    stack.hf.fail_next("*", ConnectionError("Connection refused"), times=10)
    down = stack.wait(headers, _push(stack, headers, tinker_path=path, hub="huggingface",
                                     repo_id="acme/down").json()["id"])
    assert down["status"] == "failed" and down["attempts"] == 3
    assert down["error"].startswith("push to huggingface repo acme/down failed after 3 attempts: creating the "
                                    "repo: hub unreachable (ConnectionError: Connection refused)")
    # Nothing else is affected: the next push goes through.
    stack.hf._failures.clear()
    assert stack.wait(headers, _push(stack, headers, tinker_path=path, hub="huggingface",
                                     repo_id="acme/after").json()["id"])["status"] == "done"


def test_a_retry_after_a_crash_does_not_commit_twice(stack: Stack) -> None:
    tenant, headers = stack.tenant("acme")
    path = stack.checkpoint(tenant)
    stack.http.put("/v1/hub_credentials/huggingface", json={"token": TOKEN}, headers=headers)

    def crash() -> None:  # the commit landed, then the connection died before we heard about it
        raise ConnectionError("connection lost after the commit")

    stack.hf.after_upload = crash
    push_id = _push(stack, headers, tinker_path=path, hub="huggingface", repo_id="acme/once").json()["id"]
    body = stack.wait(headers, push_id)
    commits = stack.hf.commits("acme/once")
    assert body["status"] == "done" and body["attempts"] == 2
    assert len(commits) == 1 and body["hub_revision"] == commits[0].commit_id


def test_unreachable_real_hub_fails_clearly_after_retries(stack: Stack) -> None:
    from huggingface_hub import HfApi

    from tests.s3_support import free_port

    tenant, _ = stack.tenant("acme")
    path = stack.checkpoint(tenant)
    h = stack.harness
    real = HuggingFaceClient(HfApi(endpoint=f"http://127.0.0.1:{free_port()}"))  # nothing listens there
    runner = _runner(h, {"hf": real}, stack.cipher, retries=1)
    with h.db.sessions.begin() as db:
        from services.db.hub_pushes import create_hub_push, put_hub_credential

        put_hub_credential(db, tenant.id, "hf", stack.cipher.encrypt(TOKEN))  # type: ignore[arg-type]
        push_id = create_hub_push(db, tenant.id, path, target="hf", repo="acme/x").id  # type: ignore[arg-type]
    dispatcher = InProcessDispatcher(runner, sleep=lambda _s: None)
    dispatcher.dispatch(push_id)
    for _ in range(600):
        with h.db.sessions.begin() as db:
            row = db.get(HubPushRow, push_id)
            status, error, attempts = row.status, row.error, row.attempts  # type: ignore[union-attr]
        if status == "failed":
            break
        time.sleep(0.05)
    dispatcher.shutdown()
    assert status == "failed" and attempts == 2
    assert "failed after 2 attempts" in error and "hub unreachable" in error  # type: ignore[operator]


def test_celery_worker_on_redis_runs_pushes_with_retries(stack: Stack) -> None:
    require_redis(REDIS_URL)
    from celery.contrib.testing.worker import start_worker

    tenant, headers = stack.tenant("acme")
    path = stack.checkpoint(tenant)
    stack.http.put("/v1/hub_credentials/huggingface", json={"token": TOKEN}, headers=headers)
    prefix = f"carpool-hubtest-{uuid.uuid4().hex[:8]}"
    app = celery_app(REDIS_URL, prefix=prefix)
    register_push_task(app, stack.runner)
    service = HubPushService(stack.harness.db, stack.cipher, CeleryDispatcher(app))
    stack.http.app.state.hub = service  # the cluster gateway's wiring: pushes go through the broker
    stack.hf.fail_next("upload_folder", FakeHTTPError(429, "Too Many Requests"))
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING",
                          queues=[app.conf.task_default_queue]):
            push_id = _push(stack, headers, tinker_path=path, hub="huggingface", repo_id="acme/celery").json()["id"]
            body = stack.wait(headers, push_id)
    finally:
        wipe_prefix(REDIS_URL, prefix)
    assert body["status"] == "done" and body["attempts"] == 2
    assert len(stack.hf.commits("acme/celery")) == 1


def test_cluster_mode_refuses_to_start_without_a_secret_key(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="CARPOOL_SECRET_KEY"):
        hub_cipher(ClusterSettings(data_dir=tmp_path))
    with pytest.raises(StartupError, match="at least 32"):
        hub_cipher(ClusterSettings(data_dir=tmp_path, secret_key="short"))
    assert hub_cipher(ClusterSettings(data_dir=tmp_path, secret_key="x" * 40)).decrypt(
        hub_cipher(ClusterSettings(data_dir=tmp_path, secret_key="x" * 40)).encrypt("t")) == "t"


def test_openapi_documents_hub_routes(stack: Stack) -> None:
    paths = stack.http.get("/openapi.json").json()["paths"]
    assert {"/v1/hub_pushes", "/v1/hub_pushes/{push_id}", "/v1/hub_credentials/{hub_name}"} <= set(paths)
    assert "202" in paths["/v1/hub_pushes"]["post"]["responses"]


def test_operator_token_serves_tenants_without_their_own(stack: Stack) -> None:
    tenant, headers = stack.tenant("acme")
    path = stack.checkpoint(tenant)
    h = stack.harness
    runner = PushRunner(h.db, h.store, {"hf": HuggingFaceClient(stack.hf)}, stack.cipher,  # type: ignore[dict-item]
                        operator_tokens={"hf": "hf_operator_token"}, backoff_s=0.0)
    dispatcher = InProcessDispatcher(runner, sleep=lambda _s: None)
    stack.http.app.state.hub = HubPushService(h.db, stack.cipher, dispatcher, operator_hubs={"hf": True})
    try:
        answer = _push(stack, headers, tinker_path=path, hub="huggingface", repo_id="acme/op")
        assert answer.status_code == 202
        assert stack.wait(headers, answer.json()["id"])["status"] == "done"
    finally:
        dispatcher.shutdown()
    assert stack.hf.calls[-1][2]["token"] == "hf_operator_token"
    # ModelScope has no operator token here: the tenant still needs its own.
    assert _push(stack, headers, tinker_path=path, hub="modelscope", repo_id="acme/op").status_code == 400


def test_broker_down_fails_the_push_clearly_and_it_can_be_retried(stack: Stack) -> None:
    from tests.s3_support import free_port

    tenant, headers = stack.tenant("acme")
    path = stack.checkpoint(tenant)
    stack.http.put("/v1/hub_credentials/huggingface", json={"token": TOKEN}, headers=headers)
    working = stack.http.app.state.hub
    down = celery_app(f"redis://127.0.0.1:{free_port()}/0", prefix="carpool-hubtest-down")  # nothing listens
    stack.http.app.state.hub = HubPushService(stack.harness.db, stack.cipher, CeleryDispatcher(down))
    answer = _push(stack, headers, tinker_path=path, hub="huggingface", repo_id="acme/later")
    assert answer.status_code == 503 and "/retry" in answer.json()["detail"]
    pushes = stack.http.get("/v1/hub_pushes", headers=headers).json()["hub_pushes"]
    assert pushes[0]["status"] == "failed" and "could not be queued" in pushes[0]["error"]
    stack.http.app.state.hub = working  # the broker is back
    retried = stack.http.post(f"/v1/hub_pushes/{pushes[0]['id']}/retry", headers=headers)
    assert retried.status_code == 202
    assert stack.wait(headers, pushes[0]["id"])["status"] == "done"
