"""The dashboard's two operator tools over the real gateway app and service core: "why refused" read from the
limiter's own counters, and retrying a failed hub push.

- Quota stores (in-process and real Redis): `level` reads a bucket exactly as `take` would see it and
  changes nothing; the gate remembers which quota refused a tenant last and when it lets it through.
- Scheduler page: the tenant's token level, capacity and refill time, and its last refusal, from the store
  the limiter charges (a frozen clock makes the numbers exact).
- Hub pushes: a failed push is retried from the Checkpoints page (CSRF-checked form, audited) and through
  `POST /v1/hub_pushes/{id}/retry` (tenant-scoped: a foreign id is the same 404 as an unknown one); the same
  push id runs again through the same runner; a push that is not failed answers 409 naming its state.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import BASE, Harness, build_harness
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.auth import DatabaseAuthenticator
from gateway.settings import GatewaySettings
from services.auth.tenants import Tenant, create_tenant_with_key
from services.control.api import CheckpointRef, QuotaExceeded, SaveOptions
from services.control.context import ControlOptions
from services.control.quota_store import InProcessQuotaStore, QuotaStore, RedisQuotaStore
from services.control.quotas import QuotaGate, QuotaOptions
from services.db import database_url_for_data_dir
from services.db.audit import list_audit
from services.db.ids import TenantId
from services.db.tenants import TenantQuotas
from services.domain.training import LoraSpec
from services.hub.clients import HuggingFaceClient, ModelScopeClient
from services.hub.credentials import TokenCipher
from services.hub.dispatch import InProcessDispatcher
from services.hub.runner import PushRunner
from services.hub.service import HubPushService
from tests.e2e.admin_login import form_token, login
from tests.e2e.cluster_mode import wipe_prefix
from tests.fake_clock import FakeClock
from tests.hub_fakes import FakeHfApi, FakeHTTPError, FakeMsHubApi
from tests.required import require_redis

REDIS_URL = "redis://127.0.0.1:6379/0"
WINDOW_S = 60.0


# -- the stores ----------------------------------------------------------------------------------------
@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[QuotaStore]:
    if request.param == "memory":
        yield InProcessQuotaStore(clock=FakeClock(5000.0))
        return
    import redis

    require_redis(REDIS_URL)
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=2)
    prefix = f"carpool-test-{uuid.uuid4().hex[:12]}"
    yield RedisQuotaStore(client, prefix=prefix)
    wipe_prefix(REDIS_URL, prefix)
    client.close()


# An hour-long window: on Redis's real clock, the refill during a test is far below one token.
SLOW_WINDOW_S = 3600.0


def test_level_reads_the_bucket_without_taking(store: QuotaStore) -> None:
    assert store.level("b", 100, SLOW_WINDOW_S) == 100.0  # an unknown bucket is full
    assert store.take("b", 60, 100, SLOW_WINDOW_S) == 0.0
    first = store.level("b", 100, SLOW_WINDOW_S)
    assert 40.0 <= first < 40.5
    if isinstance(store, RedisQuotaStore):  # nothing written: the hash is byte for byte the same
        client = store._client
        key = f"{store._prefix}:bucket:b"
        before = client.hgetall(key)
        store.level("b", 100, SLOW_WINDOW_S)
        assert client.hgetall(key) == before
    for _ in range(5):
        assert 40.0 <= store.level("b", 100, SLOW_WINDOW_S) < 40.5
    # Reading took nothing: the 40 tokens are all still there for the limiter, and then no more.
    assert store.take("b", 40, 100, SLOW_WINDOW_S) == 0.0
    assert store.level("b", 100, SLOW_WINDOW_S) < 0.5
    assert store.take("b", 10, 100, SLOW_WINDOW_S) > 0.0


def test_level_follows_the_refill() -> None:
    clock = FakeClock(5000.0)  # moved by hand (on Redis, the tests above use a window too long to refill)
    store = InProcessQuotaStore(clock=clock)
    store.take("r", 100, 100, WINDOW_S)
    clock.now += WINDOW_S / 4
    assert store.level("r", 100, WINDOW_S) == 25.0
    clock.now += WINDOW_S
    assert store.level("r", 100, WINDOW_S) == 100.0  # never above capacity
    assert store.take("r", 100, 100, WINDOW_S) == 0.0  # and the limiter agrees


def test_notes_are_kept_for_their_lifetime(store: QuotaStore) -> None:
    assert store.noted("n") is None
    store.note("n", "first", 600)
    store.note("n", "second", 600)
    assert store.noted("n") == "second"
    if isinstance(store, InProcessQuotaStore):
        clock = store._clock
        assert isinstance(clock, FakeClock)
        clock.now += 601
        assert store.noted("n") is None


def test_gate_reports_the_bucket_and_the_quota_that_refused(store: QuotaStore) -> None:
    gate = QuotaGate(QuotaOptions(token_window_s=SLOW_WINDOW_S), store)
    tenant = Tenant(TenantId(f"t-{uuid.uuid4().hex[:8]}"), "acme", False, TenantQuotas(tokens_per_minute=100))
    fresh = gate.standing(tenant)
    assert fresh.tokens is not None and fresh.tokens.level == 100.0 and fresh.tokens.full_in_s == 0.0
    assert fresh.last_refusal is None

    gate.charge_tokens(tenant, 70)
    with pytest.raises(QuotaExceeded) as refused:
        gate.charge_tokens(tenant, 50)
    standing = gate.standing(tenant)
    assert standing.tokens is not None and 30.0 <= standing.tokens.level < 30.5  # the refusal took nothing
    assert standing.tokens.full_in_s == pytest.approx((100 - standing.tokens.level) * SLOW_WINDOW_S / 100)
    last = standing.last_refusal
    assert last is not None and last.quota == "tokens_per_minute" and "50 tokens" in last.message
    assert last.resets_at is not None
    assert (last.resets_at - last.at).total_seconds() == pytest.approx(refused.value.retry_after_s, abs=1e-3)

    unlimited = Tenant(TenantId(f"u-{uuid.uuid4().hex[:8]}"), "free", False, TenantQuotas(max_models=1))
    assert gate.standing(unlimited).tokens is None


# -- the gateway: scheduler page and hub push retries ---------------------------------------------------
TOKEN = "hf_tenant_write_token_0123456789"


@dataclass
class Stack:
    harness: Harness
    http: TestClient
    hf: FakeHfApi
    clock: FakeClock
    admin_prefix: str

    def tenant(self, name: str, quotas: TenantQuotas | None = None) -> tuple[Tenant, dict[str, str]]:
        with self.harness.db.sessions.begin() as db:
            tenant, issued = create_tenant_with_key(db, name, quotas=quotas)
        return tenant, {"X-API-Key": issued.key}

    def csrf(self) -> str:
        return form_token(self.http.get("/admin/tenants").text)

    def failed_push(self, tenant: Tenant, headers: dict[str, str], repo: str) -> int:
        """A push the hub refused for good (HTTP 401 on its first call): failed after one attempt."""
        h = self.harness
        model = h.run(h.control.create_model(tenant, h.session(tenant), 0, BASE, LoraSpec(rank=2, seed=1), None))
        ref = h.done(tenant, h.run(h.control.save(tenant, model.model_id, 1, "training",
                                                  SaveOptions(name=repo.replace("/", "-")))).request_id)
        assert isinstance(ref, CheckpointRef)
        self.http.put("/v1/hub_credentials/huggingface", json={"token": TOKEN}, headers=headers)
        self.hf.fail_next("create_repo", FakeHTTPError(401, "Invalid credentials"))
        answer = self.http.post("/v1/hub_pushes", json={"tinker_path": ref.tinker_path, "hub": "huggingface",
                                                        "repo_id": repo}, headers=headers)
        assert answer.status_code == 202, answer.text
        push_id = int(answer.json()["id"])
        assert self.wait(headers, push_id)["status"] == "failed"
        return push_id

    def wait(self, headers: dict[str, str], push_id: int) -> dict[str, Any]:
        for _ in range(600):
            body: dict[str, Any] = self.http.get(f"/v1/hub_pushes/{push_id}", headers=headers).json()
            if body["status"] in ("done", "failed"):
                return body
            time.sleep(0.05)
        raise AssertionError(f"push {push_id} did not finish: {body}")


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("admin-operations")
    clock = FakeClock(5000.0)
    options = ControlOptions(scratch_dir=data_dir / "scratch", quotas=QuotaOptions(token_window_s=WINDOW_S))
    h = build_harness(database_url_for_data_dir(data_dir), tiny_model_dir, data_dir, options=options,
                      quota_store=InProcessQuotaStore(clock=clock))
    hf, cipher = FakeHfApi(), TokenCipher(b"t" * 32)
    runner = PushRunner(h.db, h.store, {"hf": HuggingFaceClient(hf), "ms": ModelScopeClient(FakeMsHubApi())},
                        cipher, max_retries=1, backoff_s=0.0)
    dispatcher = InProcessDispatcher(runner, sleep=lambda _s: None)
    app = create_app(GatewaySettings(), h.control, DatabaseAuthenticator(h.db, cache_seconds=0),
                     hub_pushes=HubPushService(h.db, cipher, dispatcher), admin_database=h.db)
    with h.db.sessions.begin() as db:
        _, issued = create_tenant_with_key(db, "operator", is_admin=True)
    with TestClient(app, follow_redirects=False) as http:
        assert login(http, issued.key).status_code == 303
        yield Stack(h, http, hf, clock, issued.prefix)
    dispatcher.shutdown()
    h.close()


def test_scheduler_page_shows_the_limiters_bucket_and_last_refusal(stack: Stack) -> None:
    tenant, _ = stack.tenant("metered", TenantQuotas(tokens_per_minute=100))
    page = stack.http.get("/admin/scheduler?tenant=metered").text
    assert "100 left of 100" in page and "full now" in page and "was refused over a quota" in page

    quotas = stack.harness.control.ctx.quotas  # the very gate the control plane charges requests with
    quotas.charge_tokens(tenant, 70)
    page = stack.http.get("/admin/scheduler?tenant=metered").text
    assert "30 left of 100" in page and "full again in 42.0 s" in page  # 70 tokens at 100 per 60 s

    with pytest.raises(QuotaExceeded) as refused:
        quotas.charge_tokens(tenant, 50)
    assert refused.value.retry_after_s == pytest.approx(12.0)  # 20 tokens short
    page = stack.http.get("/admin/scheduler?tenant=metered").text
    refusal = re.search(r'<dl id="last-refusal">(.*?)</dl>', page, re.S)
    assert refusal is not None and "<dd>tokens_per_minute</dd>" in refusal.group(1)
    stamps = re.findall(r"<dd>(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC</dd>", refusal.group(1))
    assert len(stamps) == 2 and stamps[0] < stamps[1]  # refused at, resets 12 s later

    stack.clock.now += 42.0
    assert "100 left of 100" in stack.http.get("/admin/scheduler?tenant=metered").text


def test_dashboard_retries_a_failed_push_once_with_csrf_and_audit(stack: Stack) -> None:
    tenant, headers = stack.tenant("pusher")
    push_id = stack.failed_push(tenant, headers, "pusher/adapter")
    listing = stack.http.get("/admin/checkpoints").text
    action = f'action="/admin/checkpoints/pushes/{push_id}/retry"'
    assert action in listing

    url = f"/admin/checkpoints/pushes/{push_id}/retry"
    assert stack.http.post(url, data={}).status_code == 403
    assert stack.http.post(url, data={"csrf": "forged"}).status_code == 403
    assert stack.http.post(url, data={"csrf": stack.csrf()},
                           headers={"Origin": "https://evil.example"}).status_code == 403
    assert stack.wait(headers, push_id)["status"] == "failed"  # nothing requeued by the refused posts

    answer = stack.http.post(url, data={"csrf": stack.csrf()})
    assert answer.status_code == 303 and answer.headers["location"] == f"/admin/checkpoints?retried={push_id}"
    done = stack.wait(headers, push_id)
    assert done["status"] == "done" and done["attempts"] == 2 and done["error"] is None
    assert len(stack.hf.commits("pusher/adapter")) == 1
    with stack.harness.db.sessions.begin() as db:
        audit = list_audit(db, tenant_id=tenant.id, limit=20, before_id=None)
    entries = [e for e in audit if e.action == "hub_push.retry"]
    assert len(entries) == 1 and entries[0].target_id == str(push_id)
    assert entries[0].actor_key_prefix == stack.admin_prefix and entries[0].detail["repo"] == "pusher/adapter"

    again = stack.http.post(url, data={"csrf": stack.csrf()})
    assert again.status_code == 409 and f"hub push {push_id} is done" in again.text
    assert action not in stack.http.get("/admin/checkpoints").text  # only failed pushes offer a retry
    assert stack.http.post("/admin/checkpoints/pushes/987654/retry", data={"csrf": stack.csrf()}).status_code == 404


def test_rest_retry_is_tenant_scoped_and_only_for_failed_pushes(stack: Stack) -> None:
    tenant, headers = stack.tenant("rest-pusher")
    _, stranger = stack.tenant("stranger")
    push_id = stack.failed_push(tenant, headers, "rest-pusher/adapter")

    foreign = stack.http.post(f"/v1/hub_pushes/{push_id}/retry", headers=stranger)
    unknown = stack.http.post("/v1/hub_pushes/987654/retry", headers=stranger)
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["field"] == unknown.json()["field"] == "push_id"
    assert stack.wait(headers, push_id)["status"] == "failed"

    answer = stack.http.post(f"/v1/hub_pushes/{push_id}/retry", headers=headers)
    assert answer.status_code == 202 and answer.json()["id"] == push_id
    assert answer.json()["status"] in ("queued", "running", "done") and answer.json()["error"] is None
    assert stack.wait(headers, push_id)["status"] == "done"

    conflict = stack.http.post(f"/v1/hub_pushes/{push_id}/retry", headers=headers)
    assert conflict.status_code == 409
    assert conflict.json() == {"detail": f"hub push {push_id} is done; only a failed push can be retried",
                               "field": "status"}
