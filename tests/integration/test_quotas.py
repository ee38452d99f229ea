"""Quotas end to end: the unmodified `tinker` SDK against a live server (uvicorn on a free port) finishes its
calls after 429s once the tenant is back under its limits; a refused seq id the client abandons is consumed
so the model is not blocked; and the Redis `QuotaStore` that several gateway processes share.

The token window is shortened to two seconds (`QuotaOptions.token_window_s`), and the live server's buckets
run on a clock that moves only by the waits its 429s announce, so refusals and retries do not depend on
how fast the box is.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tinker
import uvicorn
from fastapi import FastAPI, Request, Response
from tinker import types

from gateway.app import create_app
from gateway.auth import DatabaseAuthenticator
from gateway.settings import GatewaySettings
from services.auth.tenants import Tenant, create_tenant_with_key
from services.control.api import Done, QuotaExceeded
from services.control.context import ControlOptions
from services.control.quota_store import InProcessQuotaStore, RedisQuotaStore
from services.control.quotas import QuotaGate, QuotaOptions
from services.db import database_url_for_data_dir
from services.db.ids import ModelId, TenantId
from services.db.request_log import list_requests
from services.db.tenants import TenantQuotas, get_tenant_by_name
from services.domain.training import AdamParams, Datum, ForwardBackwardWork, LoraSpec
from tests.fake_clock import FakeClock
from tests.integration.conftest import BASE, Harness, build_harness
from tests.required import require_redis

REDIS_URL = os.environ.get("CARPOOL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
WINDOW_S = 2.0


@dataclass
class Live:
    url: str
    harness: Harness
    statuses: list[int]
    keys: dict[str, str]
    calls: list[tuple[str, int]]
    """(path, status) of every answered request, in order."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _count_statuses(app: FastAPI, statuses: list[int], calls: list[tuple[str, int]], clock: FakeClock) -> None:
    @app.middleware("http")
    async def record(request: Request, call_next):  # type: ignore[no-untyped-def]
        response: Response = await call_next(request)
        statuses.append(response.status_code)
        calls.append((request.url.path, response.status_code))
        if response.status_code == 429 and "retry-after-ms" in response.headers:
            # The buckets' clock moves only by the waits the server announces (the SDK sleeps them before
            # its retry): a refusal is certain, and so is the acceptance of the retry, however slow the box.
            clock.now += float(response.headers["retry-after-ms"]) / 1000
        return response


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    data_dir = tmp_path_factory.mktemp("quotas-live")
    options = ControlOptions(scratch_dir=data_dir / "scratch", quotas=QuotaOptions(token_window_s=WINDOW_S))
    clock = FakeClock()
    harness = build_harness(database_url_for_data_dir(data_dir), tiny_model_dir, data_dir, options=options,
                            quota_store=InProcessQuotaStore(clock=clock))
    # One tenant per test that spends tokens: buckets refill only by announced waits (the fake clock), so a
    # bucket another test drained would refuse this test's first call, in whichever order they run.
    quotas = {"tpm": TenantQuotas(tokens_per_minute=24), "tpm_sample": TenantQuotas(tokens_per_minute=24),
              "conc": TenantQuotas(max_concurrent_requests=1)}
    with harness.db.sessions.begin() as session:
        keys = {name: create_tenant_with_key(session, name, quotas=q)[1].key for name, q in quotas.items()}
    app = create_app(GatewaySettings(long_poll_seconds=5, auth_cache_seconds=0), harness.control,
                     DatabaseAuthenticator(harness.db, cache_seconds=0))
    statuses: list[int] = []
    calls: list[tuple[str, int]] = []
    _count_statuses(app, statuses, calls, clock)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started), "uvicorn did not start"
    try:
        yield Live(f"http://127.0.0.1:{port}", harness, statuses, keys, calls)
    finally:
        server.should_exit = True
        thread.join(10)
        harness.close()


def _datum(n: int) -> types.Datum:
    tokens = list(range(1, n + 2))
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n})


def test_sdk_training_call_finishes_after_429s_once_the_bucket_refills(live: Live) -> None:
    client = tinker.ServiceClient(base_url=live.url, api_key=live.keys["tpm"])
    training = client.create_lora_training_client(base_model=BASE, rank=2).result()
    calls_before = len(live.calls)
    first = training.forward_backward([_datum(16)], "cross_entropy").result()  # 16 of 24 tokens
    second = training.forward_backward([_datum(16)], "cross_entropy").result()  # 8 left: waits for 8 more
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # no tokens: never refused
    assert first.metrics["loss:sum"] > 0 and second.metrics["loss:sum"] > 0
    answers = [status for path, status in live.calls[calls_before:] if path.endswith("/forward_backward")]
    assert answers[:2] == [200, 429] and answers[-1] == 200, answers  # refused, retried until accepted
    assert 429 not in [s for path, s in live.calls[calls_before:] if path.endswith("/optim_step")]
    tenant_id, model_id = _tenant_id(live, "tpm"), ModelId(training.model_id or "")
    with live.harness.db.sessions.begin() as db:  # one request per seq id: the refusal consumed nothing
        rows = [r for r in list_requests(db, tenant_id, model_id=model_id) if r.seq_id]
    assert sorted(r.seq_id for r in rows) == [1, 2, 3] and {r.status for r in rows} == {"done"}


def test_sdk_sampling_finishes_after_429s(live: Live) -> None:
    client = tinker.ServiceClient(base_url=live.url, api_key=live.keys["tpm_sample"])
    sampler = client.create_sampling_client(base_model=BASE).result()
    params = types.SamplingParams(max_tokens=8, temperature=0.0)
    prompt = types.ModelInput.from_ints([1, 2, 3, 4])
    refusals_before = live.statuses.count(429)
    results = [sampler.sample(prompt, num_samples=1, sampling_params=params) for _ in range(3)]  # 12 each
    assert all(len(r.result().sequences[0].tokens) == 8 for r in results)
    assert live.statuses.count(429) > refusals_before


def test_sdk_pipelined_step_finishes_under_a_concurrency_limit_of_one(live: Live) -> None:
    client = tinker.ServiceClient(base_url=live.url, api_key=live.keys["conc"])
    training = client.create_lora_training_client(base_model=BASE, rank=2).result()
    tenant_id, model_id = _tenant_id(live, "conc"), ModelId(training.model_id or "")
    calls_before = len(live.calls)
    live.harness.loop.stop()  # hold the forward_backward unfinished (queued) while the optim_step arrives
    try:
        fb = training.forward_backward([_datum(8)], "cross_entropy")
        assert wait_until(lambda: _logged_seq_ids(live, tenant_id, model_id) == [1]), "fb never logged"
        optim = training.optim_step(types.AdamParams(learning_rate=1e-3))  # refused while fb is unfinished
        assert wait_until(lambda: ("/api/v1/optim_step", 429) in live.calls[calls_before:]), live.calls
    finally:
        live.harness.loop.start()
    assert fb.result().metrics["loss:sum"] > 0
    optim.result()  # the SDK's retry went through once fb had finished
    assert _logged_seq_ids(live, tenant_id, model_id) == [1, 2]


def _logged_seq_ids(live: Live, tenant_id: TenantId, model_id: ModelId) -> list[int]:
    with live.harness.db.sessions.begin() as db:
        return sorted(r.seq_id for r in list_requests(db, tenant_id, model_id=model_id) if r.seq_id)


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (False): a bound for a hang."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _tenant_id(live: Live, name: str) -> TenantId:
    with live.harness.db.sessions.begin() as db:
        row = get_tenant_by_name(db, name)
        assert row is not None
        return TenantId(row.id)


def test_an_abandoned_refused_seq_id_is_consumed_and_the_model_moves_on(tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    quotas = QuotaOptions(token_window_s=1.0, sdk_retry_gap_s=0.2, abandon_grace_s=0.2)
    options = ControlOptions(scratch_dir=tmp_path / "scratch", quotas=quotas)
    clock = FakeClock()  # the bucket and the refusal marker; the reaper's timer runs on the event loop
    h = build_harness(database_url_for_data_dir(tmp_path), tiny_model_dir, tmp_path, options=options,
                      quota_store=InProcessQuotaStore(clock=clock))
    try:
        with h.db.sessions.begin() as db:
            tenant, _ = create_tenant_with_key(db, "quitter", quotas=TenantQuotas(tokens_per_minute=10))
        control = h.control
        created = h.run(control.create_model(tenant, h.session(tenant), 0, BASE, LoraSpec(rank=2), None))
        model_id = created.model_id
        assert model_id is not None
        h.done(tenant, created.request_id)
        h.run(control.forward_backward(tenant, model_id, 1, _work(8)))  # 8 of 10 tokens
        with pytest.raises(QuotaExceeded):
            h.run(control.forward_backward(tenant, model_id, 2, _work(8)))  # refused; the client gives up
        clock.now += 10  # the bucket refills and the refusal's marker expires: no retry came in time
        later = h.run(control.optim_step(tenant, model_id, 3, AdamParams(learning_rate=1e-3)))  # the SDK's next
        # Polling runs the event loop, where the reaper's timer fires and consumes seq 2 so seq 3 can run.
        assert isinstance(h.result(tenant, later.request_id, timeout_s=60), Done)
        retry = h.run(control.forward_backward(tenant, model_id, 2, _work(8)))  # a very late retry
        assert "seq_id was consumed" in getattr(h.result(tenant, retry.request_id), "error", "")
    finally:
        h.close()


def _work(n: int) -> ForwardBackwardWork:
    tokens = np.arange(1, n + 2, dtype=np.int64)
    return ForwardBackwardWork(None, [Datum(tokens[:-1], {"target_tokens": tokens[1:],
                                                          "weights": np.ones(n, np.float32)})])


@pytest.fixture
def redis_client() -> Iterator[object]:
    import redis

    require_redis(REDIS_URL)
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=2)
    yield client
    client.close()


def test_redis_store_is_one_bucket_for_every_gateway_process(redis_client: object) -> None:
    prefix = f"carpool-test-{uuid.uuid4().hex[:12]}"
    gateway_a, gateway_b = RedisQuotaStore(redis_client, prefix=prefix), RedisQuotaStore(redis_client, prefix=prefix)
    assert gateway_a.take("t", 600, capacity=1000, window_s=60) == 0.0
    wait_s = gateway_b.take("t", 600, capacity=1000, window_s=60)  # the other process sees the same bucket
    # 200 tokens missing at 1000 per minute: 12 s, less whatever refilled between the two calls (Redis's
    # clock; the exact arithmetic is checked on a fake clock in tests/unit/test_quotas_core.py).
    assert 0 < wait_s <= 200 / (1000 / 60)
    assert gateway_a.take("t", 600, capacity=1000, window_s=60) > 0  # refused on either: nothing was taken
    assert gateway_a.take("other", 1000, capacity=1000, window_s=60) == 0.0
    gateway_a.mark("refused:m:1", 0.2)
    gateway_a.mark("refused:m:2", 600)
    assert wait_until(lambda: not gateway_b.marked("refused:m:1")), "the 0.2 s marker never expired"
    assert gateway_b.marked("refused:m:2")  # seen by the other process until it expires


def test_redis_store_refills_and_is_exact_about_when(redis_client: object) -> None:
    store = RedisQuotaStore(redis_client, prefix=f"carpool-test-{uuid.uuid4().hex[:12]}")
    gate = QuotaGate(QuotaOptions(token_window_s=1.0), store)
    tenant = Tenant(TenantId("tenant-r"), "r", False, TenantQuotas(tokens_per_minute=100))
    gate.charge_tokens(tenant, 100)
    with pytest.raises(QuotaExceeded) as refused:
        gate.charge_tokens(tenant, 50)
    first_hint = refused.value.retry_after_s
    assert 0 < first_hint <= 0.5  # 50 tokens at 100 per second, less what refilled since (Redis's clock)
    with pytest.raises(QuotaExceeded) as again:
        gate.charge_tokens(tenant, 50)
    assert 0 < again.value.retry_after_s <= first_hint  # the wait only shrinks: the refusal took nothing

    def accepted() -> bool:
        try:
            gate.charge_tokens(tenant, 50)
        except QuotaExceeded:
            return False
        return True

    assert wait_until(accepted), "the bucket never refilled"
    with pytest.raises(QuotaExceeded):  # and that took the 50 again
        gate.charge_tokens(tenant, 100)


def test_quota_refusals_leave_the_event_loop_usable() -> None:
    """The reaper's timers live on the caller's loop; a closed loop must not make the same gate fail later.

    One gate for both loops (as one control plane outlives a test client's loop): the first loop closes
    with a timer still pending; the second refuses the same seq id again, which replaces that timer, and
    its own timer must still fire and consume the seq id.
    """
    gate = QuotaGate(QuotaOptions(sdk_retry_gap_s=0.01, abandon_grace_s=0.01))
    tenant = Tenant(TenantId("t"), "t", False, TenantQuotas())
    consumed: list[tuple[int, asyncio.AbstractEventLoop]] = []

    async def consume(_t: Tenant, _m: ModelId, seq_id: int, _error: str) -> None:
        consumed.append((seq_id, asyncio.get_running_loop()))

    async def refuse_and_leave() -> None:
        gate.refused(tenant, ModelId("m"), 1, 0.01, consume)  # the loop ends before the timer fires

    async def refuse_and_wait() -> asyncio.AbstractEventLoop:
        gate.refused(tenant, ModelId("m"), 1, 0.01, consume)
        while not consumed:
            await asyncio.sleep(0.01)
        return asyncio.get_running_loop()

    asyncio.run(refuse_and_leave())
    assert consumed == []
    second_loop = asyncio.run(asyncio.wait_for(refuse_and_wait(), timeout=30))
    assert consumed == [(1, second_loop)]  # consumed once, by the timer on the live loop
