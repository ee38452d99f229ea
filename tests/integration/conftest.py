"""Fixtures for control-plane and runtime tests: the whole service core without HTTP.

A `Harness` wires a real `Engine` on the tiny model, a `SchedulerLoop` thread, in-memory queue / results /
notifier, a migrated database (SQLite by default, PostgreSQL where a test asks) and a local checkpoint
store into one `ServiceControlPlane`, and runs the plane's coroutines on one event loop per test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from services.auth.tenants import Tenant, create_tenant_with_key
from services.control.api import Done, Failed, FutureState, Pending
from services.control.context import ControlOptions
from services.control.plane import ServiceControlPlane
from services.control.quota_store import QuotaStore
from services.control.recording import DatabaseCompletionHook
from services.control.registry import ServedModel
from services.db import Database, database_url_for_data_dir, open_database
from services.db.ids import RequestId, SessionId
from services.db.tenants import TenantQuotas
from services.db.testing import scratch_postgres_database
from services.jobqueue import InMemoryNotifier, InMemoryResultStore, InMemoryWorkQueue
from services.runtime import LoopConfig, SchedulerLoop
from services.scheduler import Scheduler, SchedulerLimits
from services.storage import CheckpointStore, LocalCheckpointStore, UrlSigner
from services.storage.s3 import S3CheckpointStore
from services.storage.staging import StagedBackend
from tests.required import require_postgres
from worker.engine.engine import Engine, EngineConfig

T = TypeVar("T")
BASE = "tiny-base"
SECRET = b"0123456789abcdef0123456789abcdef"


@dataclass
class Harness:
    control: ServiceControlPlane
    loop: SchedulerLoop
    engine: Engine
    db: Database
    store: CheckpointStore
    queue: InMemoryWorkQueue
    aio: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.aio.run_until_complete(coro)

    def tenant(self, name: str, *, max_models: int | None = None) -> Tenant:
        with self.db.sessions.begin() as db:
            tenant, _ = create_tenant_with_key(db, name, quotas=TenantQuotas(max_models=max_models))
        return tenant

    def session(self, tenant: Tenant) -> SessionId:
        return self.run(
            self.control.create_session(
                tenant, tags=[], user_metadata={}, sdk_version="0.38.0", project_id=None
            )
        )

    def result(self, tenant: Tenant, request_id: RequestId, timeout_s: float = 60.0) -> Done | Failed:
        """Poll `retrieve` like the SDK until the future ends."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state: FutureState = self.run(self.control.retrieve(tenant, request_id, 5.0))
            if not isinstance(state, Pending):
                return state
        raise AssertionError(f"request {request_id} did not finish within {timeout_s} s")

    def done(self, tenant: Tenant, request_id: RequestId) -> Any:
        """The result of a request that must succeed."""
        state = self.result(tenant, request_id)
        assert isinstance(state, Done), state
        return state.result

    def close(self) -> None:
        self.loop.stop()
        self.control.close()
        self.aio.close()
        self.db.dispose()


def build_harness(
    database_url: str,
    model_dir: Path,
    data_dir: Path,
    *,
    batch_window_s: float = 0.005,
    options: ControlOptions | None = None,
    store: CheckpointStore | None = None,
    quota_store: QuotaStore | None = None,
) -> Harness:
    """A control plane + loop + engine; `store` (default: local under data_dir) may be an S3 store;
    `quota_store` (default: in-process on the real clock) lets a test drive the token buckets' clock."""
    db = open_database(database_url, migrate=True)
    engine = Engine(model_dir, name=BASE, config=EngineConfig(device="cpu", dtype="float32"))
    store = store or LocalCheckpointStore(data_dir / "checkpoints", UrlSigner(SECRET))
    queue, results, notifier = InMemoryWorkQueue(), InMemoryResultStore(), InMemoryNotifier()
    loop = SchedulerLoop(
        BASE,
        StagedBackend(engine, store) if isinstance(store, S3CheckpointStore) else engine,
        queue,
        results,
        notifier,
        scheduler=Scheduler(SchedulerLimits(max_tokens_per_pass=4096)),
        hook=DatabaseCompletionHook(db),
        config=LoopConfig(poll_s=0.05, batch_window_s=batch_window_s),
    )
    served = ServedModel(engine.info, engine.limits, queue=BASE, stats=loop.stats)
    opts = options or ControlOptions(scratch_dir=data_dir / "scratch")
    control = ServiceControlPlane(db, queue, results, notifier, store, [served], opts, quota_store=quota_store)
    loop.start()
    return Harness(control, loop, engine, db, store, queue)


@pytest.fixture
def harness(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Harness]:
    h = build_harness(database_url_for_data_dir(tmp_path), tiny_model_dir, tmp_path)
    yield h
    h.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def harness_on_each_database(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Harness]:
    """A harness once on SQLite (embedded mode's store) and once on a scratch PostgreSQL (cluster mode's)."""
    if request.param == "sqlite":
        h = build_harness(database_url_for_data_dir(tmp_path), tiny_model_dir, tmp_path)
        yield h
        h.close()
        return
    require_postgres()
    with scratch_postgres_database() as url:
        h = build_harness(url, tiny_model_dir, tmp_path)
        yield h
        h.close()


@pytest.fixture
def postgres_harness(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Harness]:
    require_postgres()
    with scratch_postgres_database() as url:
        h = build_harness(url, tiny_model_dir, tmp_path)
        yield h
        h.close()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    """A migrated database per test module, once on SQLite and once on a scratch PostgreSQL database."""
    if request.param == "sqlite":
        database = open_database(database_url_for_data_dir(tmp_path_factory.mktemp("sqlite")), migrate=True)
        yield database
        database.dispose()
        return
    require_postgres()
    with scratch_postgres_database() as url:
        database = open_database(url, migrate=True)
        yield database
        database.dispose()
