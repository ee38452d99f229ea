"""The embedded deployment built as `carpool serve` builds it (tiny model, SQLite, no uvicorn): the admin
key is printed on first start only, the scheduler loop trains through the control plane, restarts fail
what was left unfinished, and the gateway app is wired onto the same control plane."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from deploy.embedded import (
    RESTART_ERROR,
    StartupError,
    build_embedded,
    build_gateway_app,
    resolve_base_models,
)
from deploy.settings import ServiceSettings
from services.auth.keys import looks_like_api_key
from services.auth.tenants import authenticate
from services.control.api import Done, Failed, ModelCreated
from services.db.ids import TenantId
from services.db.request_log import get_request
from services.domain.training import Datum, ForwardBackwardWork, LoraSpec


def _settings(tmp_path: Path, model_dir: Path) -> ServiceSettings:
    return ServiceSettings(
        data_dir=tmp_path / "data",
        base_models=[f"tiny={model_dir}"],
        device="cpu",
        dtype="float32",
        batch_window_ms=1.0,
    )


def test_embedded_service_end_to_end(tmp_path: Path, tiny_model_dir: Path) -> None:
    import asyncio

    out = io.StringIO()
    service = build_embedded(_settings(tmp_path, tiny_model_dir), out=out)
    key = out.getvalue().strip().splitlines()[-1]
    assert looks_like_api_key(key)
    with service.db.sessions.begin() as db:
        admin = authenticate(db, key)
    assert admin is not None and admin.is_admin
    assert [m.name for m in service.control.base_models()] == ["tiny"]
    assert (tmp_path / "data" / "secrets" / "url-signing.key").is_file()

    service.start()
    aio = asyncio.new_event_loop()
    try:
        control = service.control
        session = aio.run_until_complete(
            control.create_session(admin, tags=[], user_metadata={}, sdk_version=None, project_id=None)
        )
        created = aio.run_until_complete(
            control.create_model(admin, session, 0, "tiny", LoraSpec(rank=2), None)
        )
        state = aio.run_until_complete(control.retrieve(admin, created.request_id, 20.0))
        assert state == Done("create_model", ModelCreated(created.model_id))
        seq = np.arange(1, 10)
        work = ForwardBackwardWork(None, [Datum(seq[:-1], {"target_tokens": seq[1:]})])
        fb = aio.run_until_complete(control.forward_backward(admin, created.model_id, 1, work))
        assert isinstance(aio.run_until_complete(control.retrieve(admin, fb.request_id, 20.0)), Done)
        # Left queued when the process "dies": seq 3 waits for the seq 2 that never comes.
        stuck = aio.run_until_complete(control.forward_backward(admin, created.model_id, 3, work))
        assert control.runtime_stats()[0].passes >= 1
    finally:
        aio.close()
        service.stop()

    again = io.StringIO()
    restarted = build_embedded(_settings(tmp_path, tiny_model_dir), out=again)
    try:
        assert again.getvalue() == ""  # the admin key is never shown twice
        with restarted.db.sessions.begin() as db:
            row = get_request(db, TenantId(admin.id), stuck.request_id)
            assert row is not None and row.status == "failed" and row.error == RESTART_ERROR
        aio = asyncio.new_event_loop()
        try:
            state = aio.run_until_complete(restarted.control.retrieve(admin, stuck.request_id, 0.1))
        finally:
            aio.close()
        assert isinstance(state, Failed) and state.category == "server"
    finally:
        restarted.stop()


def test_gateway_app_is_wired_to_the_control_plane(tmp_path: Path, tiny_model_dir: Path) -> None:
    from fastapi.testclient import TestClient

    out = io.StringIO()
    service = build_embedded(_settings(tmp_path, tiny_model_dir), out=out)
    key = out.getvalue().strip().splitlines()[-1]
    try:
        client = TestClient(build_gateway_app(service.settings, service))
        assert client.get("/api/v1/healthz").status_code == 200
        created = client.post(
            "/api/v1/create_session",
            headers={"X-API-Key": key},
            json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"},
        )
        assert created.status_code == 200, created.text
        assert created.json()["session_id"].startswith("sess-")
        denied = client.post("/api/v1/create_session", headers={"X-API-Key": "tml-" + "x" * 43}, json={})
        assert denied.status_code == 401
    finally:
        service.stop()


def test_unresolvable_base_model_says_what_to_do(tmp_path: Path) -> None:
    settings = ServiceSettings(data_dir=tmp_path, base_models=["mine=/no/such/model/dir"])
    with pytest.raises(StartupError) as caught:
        resolve_base_models(settings)
    assert "mine" in str(caught.value) and "--base-model" in str(caught.value)
