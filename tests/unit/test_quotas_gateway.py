"""Quotas and the capacity signal through the gateway over the real service core (TestClient, tiny model):
429 with `Retry-After` / `retry-after-ms` in the form the SDK honours, a refused training request that does
not consume its seq id (its retry succeeds), the concurrency limit and its gap exemption, the model limit,
and `queue_state: paused_capacity` on `retrieve_future` while a request waits on a saturated model."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from tinker import types
from tinker._base_client import BaseClient
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.types.try_again_response import TryAgainResponse

from gateway.app import create_app
from gateway.auth import DatabaseAuthenticator
from gateway.settings import GatewaySettings
from services.auth.tenants import create_tenant_with_key
from services.control.context import ControlOptions
from services.control.plane import ServiceControlPlane
from services.control.quota_store import InProcessQuotaStore
from services.control.quotas import QuotaOptions
from services.control.recording import DatabaseCompletionHook
from services.control.registry import ServedModel
from services.db import Database, database_url_for_data_dir, open_database
from services.db.ids import TenantId
from services.db.tenants import TenantQuotas, get_tenant_by_name, set_tenant_quotas
from services.jobqueue import InMemoryNotifier, InMemoryResultStore, InMemoryWorkQueue
from services.runtime import LoopConfig, SchedulerLoop
from services.scheduler import Scheduler
from services.storage import LocalCheckpointStore, UrlSigner
from tests.fake_clock import FakeClock

BASE = "tiny-base"
DATUM_TOKENS = 5
TENANTS = {
    "tpm": TenantQuotas(tokens_per_minute=8),  # per 1 s window here: one 5-token request, then 3 left
    "conc": TenantQuotas(max_concurrent_requests=1),
    "models": TenantQuotas(max_models=1),
    "plain": TenantQuotas(),
}


@dataclass
class Stack:
    http: TestClient
    db: Database
    loop: SchedulerLoop
    keys: dict[str, str]
    clock: FakeClock


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from worker.engine.engine import Engine, EngineConfig

    data_dir = tmp_path_factory.mktemp("quotas-gateway")
    db = open_database(database_url_for_data_dir(data_dir), migrate=True)
    engine = Engine(tiny_model_dir, name=BASE, config=EngineConfig(device="cpu", dtype="float32"))
    queue, results, notifier = InMemoryWorkQueue(), InMemoryResultStore(), InMemoryNotifier()
    loop = SchedulerLoop(BASE, engine, queue, results, notifier, scheduler=Scheduler(),
                         hook=DatabaseCompletionHook(db), config=LoopConfig(poll_s=0.05))
    served = ServedModel(engine.info, engine.limits, queue=BASE, stats=loop.stats)
    store = LocalCheckpointStore(data_dir / "checkpoints", UrlSigner(b"0123456789abcdef0123456789abcdef"))
    quotas = QuotaOptions(token_window_s=1.0, saturation_wait_s=2.0, saturation_queue_depth=None)
    clock = FakeClock()
    control = ServiceControlPlane(db, queue, results, notifier, store, [served],
                                  ControlOptions(scratch_dir=data_dir / "scratch", quotas=quotas),
                                  quota_store=InProcessQuotaStore(clock=clock))
    with db.sessions.begin() as session:
        keys = {name: create_tenant_with_key(session, name, quotas=q)[1].key for name, q in TENANTS.items()}
    settings = GatewaySettings(long_poll_seconds=0.5, auth_cache_seconds=0)
    app = create_app(settings, control, DatabaseAuthenticator(db, cache_seconds=0))
    loop.start()
    with TestClient(app) as http:
        yield Stack(http, db, loop, keys, clock)
    loop.stop()
    db.dispose()


class Caller:
    """One tenant speaking the wire protocol as SDK 0.38 does (only what these tests need)."""

    def __init__(self, stack: Stack, tenant: str) -> None:
        self.http = stack.http
        self.headers = {"X-API-Key": stack.keys[tenant]}

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(f"/api/v1/{path}", json=body, headers=self.headers)

    def poll(self, request_id: str) -> dict[str, Any]:
        response = self.post("retrieve_future", {"request_id": request_id, "allow_metadata_only": True})
        assert response.status_code == 200, response.text
        return dict(response.json())

    def result(self, request_id: str, timeout_s: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            answer = self.poll(request_id)
            if answer.get("type") != "try_again":
                assert "error" not in answer, answer
                return answer
        raise AssertionError(f"{request_id} did not finish")

    def model(self, seq: int = 0, expect: int = 200) -> httpx.Response:
        if not hasattr(self, "session_id"):
            body = {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"}
            self.session_id = self.post("create_session", body).json()["session_id"]
        body = {"session_id": self.session_id, "model_seq_id": seq, "base_model": BASE,
                "lora_config": {"rank": 2}, "type": "create_model"}
        response = self.post("create_model", body)
        assert response.status_code == expect, response.text
        if expect == 200:
            self.result(response.json()["request_id"])
        return response

    def forward_backward(self, model_id: str, seq_id: int) -> httpx.Response:
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(list(range(1, DATUM_TOKENS + 1))),
            loss_fn_inputs={"target_tokens": np.arange(2, DATUM_TOKENS + 2, dtype=np.int64),
                            "weights": np.ones(DATUM_TOKENS, dtype=np.float32)},
        )
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
            model_id=model_id, seq_id=seq_id,
        )
        body = forward_backward_request_to_proto(request).SerializeToString()
        return self.http.post("/api/v1/forward_backward", content=body,
                              headers={**self.headers, "Content-Type": "application/x-protobuf"})


def sdk_retry_delay(response: httpx.Response) -> float | None:
    """The delay the SDK's own header parser reads (it honours values in (0, 60])."""
    return BaseClient._parse_retry_after_header(None, httpx.Headers(response.headers))  # type: ignore[arg-type]


def test_over_tokens_per_minute_is_429_and_the_retry_of_the_same_seq_id_succeeds(stack: Stack) -> None:
    tpm = Caller(stack, "tpm")
    model_id = tpm.model().json()["model_id"]
    stack.clock.now += 60  # a full bucket, whatever ran before
    assert tpm.forward_backward(model_id, 1).status_code == 200
    refused = tpm.forward_backward(model_id, 2)
    assert refused.status_code == 429, refused.text
    wait_s = (DATUM_TOKENS - (8 - DATUM_TOKENS)) / 8  # 2 missing tokens at 8 per second (the clock stood still)
    assert int(refused.headers["Retry-After"]) == math.ceil(wait_s)
    assert float(refused.headers["retry-after-ms"]) == pytest.approx(wait_s * 1000, abs=1)  # ms rounding only
    assert 0 < (sdk_retry_delay(refused) or 0) <= 60  # the SDK will wait exactly that, then retry
    assert "tokens per minute" in refused.json()["detail"]
    stack.clock.now += wait_s * 0.9
    assert tpm.forward_backward(model_id, 2).status_code == 429  # not yet: the hint was not too long
    stack.clock.now += wait_s * 0.1
    accepted = tpm.forward_backward(model_id, 2)  # the SDK re-sends the same seq id: not consumed
    assert accepted.status_code == 200, accepted.text
    assert "loss:sum" in tpm.result(accepted.json()["request_id"])["metrics"]


def test_a_request_that_could_never_fit_the_limit_is_a_400_and_consumes_its_seq_id(stack: Stack) -> None:
    tpm = Caller(stack, "tpm")
    model_id = tpm.model(seq=1).json()["model_id"]
    big = TENANTS["tpm"].tokens_per_minute or 0
    with stack.db.sessions.begin() as session:  # shrink the limit below one request
        row = get_tenant_by_name(session, "tpm")
        assert row is not None
        set_tenant_quotas(session, TenantId(row.id), TenantQuotas(tokens_per_minute=DATUM_TOKENS - 1))
    try:
        refused = tpm.forward_backward(model_id, 1)
        assert refused.status_code == 400 and refused.json()["field"] == "data", refused.text
        optim = tpm.post("optim_step", {"model_id": model_id, "seq_id": 2, "type": "optim_step",
                                        "adam_params": {"learning_rate": 1e-3}})
        assert optim.status_code == 200
        tpm.result(optim.json()["request_id"])  # seq 1 was consumed, so seq 2 runs
    finally:
        with stack.db.sessions.begin() as session:
            row = get_tenant_by_name(session, "tpm")
            assert row is not None
            set_tenant_quotas(session, TenantId(row.id), TenantQuotas(tokens_per_minute=big))


def test_concurrency_limit_refuses_new_work_but_not_a_request_that_fills_a_gap(stack: Stack) -> None:
    conc = Caller(stack, "conc")
    first = conc.model(0).json()["model_id"]
    second = conc.model(1).json()["model_id"]
    waiting = conc.forward_backward(first, 2)  # seq 1 not sent yet: this one stays queued
    assert waiting.status_code == 200
    refused = conc.forward_backward(second, 1)
    assert refused.status_code == 429, refused.text
    assert refused.headers["Retry-After"] == "1" and "unfinished requests" in refused.json()["detail"]
    gap = conc.forward_backward(first, 1)  # seq 2 waits for it: refusing it would deadlock the model
    assert gap.status_code == 200, gap.text
    conc.result(gap.json()["request_id"])
    conc.result(waiting.json()["request_id"])
    retried = conc.forward_backward(second, 1)  # the SDK's retry, now under the limit
    assert retried.status_code == 200, retried.text
    conc.result(retried.json()["request_id"])


def test_model_limit_is_429(stack: Stack) -> None:
    models = Caller(stack, "models")
    models.model(0)
    refused = models.model(1, expect=429)
    assert refused.headers["Retry-After"] == "60" and "limit is 1" in refused.json()["detail"]


def test_pending_future_reports_paused_capacity_while_it_waits_on_a_saturated_model(stack: Stack) -> None:
    plain = Caller(stack, "plain")
    model_id = plain.model().json()["model_id"]
    waiting = plain.forward_backward(model_id, 2).json()["request_id"]  # queued until seq 1 arrives
    early = TryAgainResponse.model_validate(plain.poll(waiting), strict=True)
    assert early.queue_state == "active"
    late = plain.poll(waiting)  # the long poll (0.5 s) answers try_again until the 2 s saturation wait passed
    deadline = time.monotonic() + 60
    while late.get("queue_state") == "active" and time.monotonic() < deadline:
        late = plain.poll(waiting)
    assert TryAgainResponse.model_validate(late, strict=True).queue_state == "paused_capacity"
    assert "capacity" in late["queue_state_reason"]
    plain.forward_backward(model_id, 1)
    assert "loss:sum" in plain.result(waiting)["metrics"]
