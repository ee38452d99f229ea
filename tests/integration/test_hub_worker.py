"""`carpool hub-worker` as a real process: the Celery worker on the Redis broker executes a push queued the
way a cluster gateway queues it; the hub (the real `HfApi`, pointed at a port where nothing listens) is
unreachable, so the push ends `failed` after its retries with a clear message — and the worker refuses to
start without `CARPOOL_SECRET_KEY`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.auth.tenants import create_tenant_with_key
from services.db import open_database
from services.db.checkpoints import create_checkpoint
from services.db.hub_pushes import create_hub_push, get_hub_push, put_hub_credential
from services.db.ids import ModelId, TenantId
from services.db.runs import create_training_run
from services.db.schema import upgrade_to_head
from services.db.sessions import create_session
from services.db.testing import scratch_postgres_database
from services.hub.credentials import TokenCipher
from services.hub.dispatch import CeleryDispatcher, celery_app
from services.storage import LocalCheckpointStore
from tests.e2e.cluster_mode import wipe_prefix
from tests.required import require_postgres, require_redis
from tests.s3_support import free_port

SECRET = "hub-worker-test-server-secret-0123456789"
REDIS_URL = os.environ.get("CARPOOL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
CARPOOL = str(Path(sys.executable).with_name("carpool"))


@pytest.fixture
def database_url() -> Iterator[str]:
    require_postgres()
    require_redis(REDIS_URL)
    with scratch_postgres_database() as url:
        upgrade_to_head(url)
        yield url


def _queued_push(url: str, data_dir: Path) -> tuple[int, str]:
    db = open_database(url)
    try:
        with db.sessions.begin() as s:
            tenant, _ = create_tenant_with_key(s, "acme")
            tid = TenantId(tenant.id)
            session = create_session(s, tid)
            run = create_training_run(s, tid, session.id, 0, base_model="org/base", lora_rank=4)
            store = LocalCheckpointStore(data_dir / "checkpoints")
            uri = store.uri_for(tenant.id, run.id, "training", "w")
            folder = store.local_path(uri)
            folder.mkdir(parents=True)
            (folder / "adapter_config.json").write_text(json.dumps({"r": 4}))
            (folder / "adapter_model.safetensors").write_bytes(b"weights")
            path = f"tinker://{run.id}/weights/w"
            create_checkpoint(s, tid, ModelId(run.id), "weights/w", kind="training", tinker_path=path,
                              storage_uri=uri)
            put_hub_credential(s, tid, "hf", TokenCipher.from_setting(SECRET).encrypt("hf_token"))
            return create_hub_push(s, tid, path, target="hf", repo="acme/x").id, tenant.id
    finally:
        db.dispose()


def test_hub_worker_process_fails_an_unreachable_push_after_its_retries(database_url: str, tmp_path: Path) -> None:
    prefix = f"carpool-hubworker-{uuid.uuid4().hex[:8]}"
    push_id, tenant_id = _queued_push(database_url, tmp_path / "data")
    env = {**os.environ, "CARPOOL_DATABASE_URL": database_url, "CARPOOL_REDIS_URL": REDIS_URL,
           "CARPOOL_REDIS_PREFIX": prefix, "CARPOOL_SECRET_KEY": SECRET, "CARPOOL_DATA_DIR": str(tmp_path / "data"),
           "CARPOOL_HUB_PUSH_MAX_RETRIES": "1", "CARPOOL_HUB_TIMEOUT_SECONDS": "5", "CARPOOL_ALLOW_INSECURE_REDIS": "1",
           "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HUB_OFFLINE": "0"}
    log = tmp_path / "hub-worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen([CARPOOL, "hub-worker", "--concurrency", "1"], env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
    db = open_database(database_url)
    try:
        CeleryDispatcher(celery_app(REDIS_URL, prefix=prefix)).dispatch(push_id)  # what a cluster gateway does
        row = None
        for _ in range(1200):
            with db.sessions.begin() as s:
                row = get_hub_push(s, TenantId(tenant_id), push_id)
                status, error, attempts = row.status, row.error, row.attempts  # type: ignore[union-attr]
            if status == "failed" or worker.poll() is not None:
                break
            time.sleep(0.1)
        assert status == "failed", log.read_text()[-3000:]
        assert attempts == 2 and "failed after 2 attempts" in error and "hub unreachable" in error  # type: ignore[operator]
        assert "hf_token" not in log.read_text()
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        db.dispose()
        wipe_prefix(REDIS_URL, prefix)


def test_hub_worker_refuses_to_start_without_a_secret_key(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CARPOOL_SECRET_KEY"}
    done = subprocess.run([CARPOOL, "hub-worker"], env={**env, "CARPOOL_DATA_DIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "CARPOOL_SECRET_KEY" in done.stdout + done.stderr


def test_cluster_up_runs_a_hub_worker_that_consumes_pushes_and_stops_with_it(
        database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`carpool cluster up` starts one `carpool hub-worker` child (`hub_worker_process`) with the cluster's
    settings: a push queued by the gateway is executed (here: failed, the hub is unreachable) instead of
    staying queued, and stopping the cluster stops the child."""
    from deploy.child_process import child_env
    from deploy.cluster_commands import cluster_settings
    from deploy.hub_process import hub_worker_process

    prefix = f"carpool-hubup-{uuid.uuid4().hex[:8]}"
    push_id, tenant_id = _queued_push(database_url, tmp_path / "data")
    for key, value in {"CARPOOL_DATABASE_URL": database_url, "CARPOOL_REDIS_URL": REDIS_URL,
                       "CARPOOL_REDIS_PREFIX": prefix, "CARPOOL_SECRET_KEY": SECRET,
                       "CARPOOL_HUB_PUSH_MAX_RETRIES": "0", "CARPOOL_HUB_TIMEOUT_SECONDS": "5",
                       "CARPOOL_ALLOW_INSECURE_REDIS": "1", "CARPOOL_METRICS_PORT": str(free_port()),
                       "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HUB_OFFLINE": "0"}.items():
        monkeypatch.setenv(key, value)
    settings = cluster_settings(data_dir=tmp_path / "data")
    env = child_env(settings)
    assert env["CARPOOL_DATA_DIR"] == str(tmp_path / "data") and "CARPOOL_METRICS_PORT" not in env
    worker = hub_worker_process(settings, concurrency=1, log_file=tmp_path / "hub.log", stop_timeout_s=20)
    worker.start()
    db = open_database(database_url)
    try:
        CeleryDispatcher(celery_app(REDIS_URL, prefix=prefix)).dispatch(push_id)
        status = "queued"
        for _ in range(1200):
            with db.sessions.begin() as s:
                status = get_hub_push(s, TenantId(tenant_id), push_id).status  # type: ignore[union-attr]
            if status == "failed" or not worker.running:
                break
            time.sleep(0.1)
        assert status == "failed", (tmp_path / "hub.log").read_text()[-3000:]
        pid = worker.pid
        assert worker.running and pid is not None
        worker.stop()
        assert not worker.running and worker.pid is None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped: the child is gone, not a zombie
    finally:
        worker.stop()
        db.dispose()
        wipe_prefix(REDIS_URL, prefix)
