"""Support for the cluster tests: a whole cluster in one test process, private servers, reference runs.

`ClusterStack` wires the production parts exactly as `carpool cluster up` does — PostgreSQL, Redis,
`SchedulerService`, the cluster gateway app served by uvicorn on a free port — with worker replicas hosted
either on threads (`ReplicaHost`, fast) or by Ray Serve (the test names which). `PrivateRedis` (AOF, fsync
always) and `PrivatePostgres` are throwaway servers the restart tests may stop and start at will; the
shared servers of the box are never disturbed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
from safetensors.torch import load_file
from sqlalchemy import select

from deploy.cluster_gateway import ClusterGateway, build_cluster_gateway
from deploy.cluster_wiring import cluster_config, process_name
from deploy.scheduler_service import SchedulerService
from deploy.settings import ClusterSettings
from services.db import open_database
from services.db.models import CheckpointRow
from services.db.schema import upgrade_to_head
from services.domain.training import AdamParams, AdapterId, Datum, ForwardBackwardWork, LoraSpec
from services.runtime.redis_replicas import connect
from tests.e2e.cluster_mode import wipe_prefix
from tests.e2e.server import free_port, is_carpool_health
from worker.engine.engine import Engine, EngineConfig

REDIS_URL = os.environ.get("CARPOOL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
TEST_SECRET_KEY = "cluster-tests-server-secret-key-0123456789"


def postgres_bin_dir() -> Path | None:
    """Where `initdb` and `pg_ctl` live: `pg_config --bindir` when it has them, else the newest
    /usr/lib/postgresql/<version>/bin (Debian keeps them off PATH); None when PostgreSQL is not installed."""
    candidates: list[Path] = []
    if (pg_config := shutil.which("pg_config")) is not None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            candidates.append(Path(subprocess.run([pg_config, "--bindir"], capture_output=True, text=True,
                                                  check=True, timeout=10).stdout.strip()))
    versions = [p for p in Path("/usr/lib/postgresql").glob("*/bin") if p.parent.name.isdigit()]
    candidates += sorted(versions, key=lambda p: int(p.parent.name), reverse=True)
    return next((c for c in candidates if (c / "initdb").is_file() and (c / "pg_ctl").is_file()), None)
BASE = "carpool/tiny-cluster"


def wait_until(condition: Callable[[], bool], timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s: {message}")


def cluster_settings(data_dir: Path, model_dir: Path, database_url: str, redis_url: str, prefix: str,
                     **overrides: Any) -> ClusterSettings:
    values: dict[str, Any] = dict(
        data_dir=data_dir, base_models=[f"{BASE}={model_dir}"], database_url=database_url, redis_url=redis_url,
        redis_prefix=prefix, device="cpu", dtype="float32", heartbeat_ttl_seconds=1.5, snapshot_every_steps=2,
        scheduler_lease_seconds=3.0, batch_window_ms=20.0, replica_wait_seconds=60.0, model_info_wait_seconds=120.0,
        allow_insecure_redis=True,  # the test Redis has no password
        secret_key=TEST_SECRET_KEY,  # cluster mode refuses to start without one (hub tokens at rest)
    )
    values.update(overrides)
    return ClusterSettings(**values)


# -- the stack ----------------------------------------------------------------------------------------------
class UvicornThread:
    """A uvicorn server on a thread, stoppable and restartable on the same port."""

    def __init__(self, app: Any, port: int) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "uvicorn did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@dataclass
class ClusterStack:
    settings: ClusterSettings
    port: int = field(default_factory=free_port)
    replicas: list[Any] = field(default_factory=list)
    scheduler: SchedulerService | None = None
    gateway: ClusterGateway | None = None
    http: UvicornThread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_thread_replica(self) -> Any:
        from worker.serve.replica import ReplicaHost

        config = cluster_config(self.settings)
        host = ReplicaHost(config.spec(BASE), config)
        self.replicas.append(host)
        return host

    def start_scheduler(self) -> SchedulerService:
        scheduler = self.start_standby()
        wait_until(lambda: scheduler.loop is not None, 30, "no lease")
        return scheduler

    def start_standby(self) -> SchedulerService:
        """A scheduler service that leads as soon as it gets the lease."""
        db = open_database(self.settings.resolved_database_url())
        self.scheduler = SchedulerService(self.settings, BASE, connect(self.settings.redis_url), db,
                                          process_name("test-scheduler"))
        self.scheduler.start()
        return self.scheduler

    def start_gateway(self) -> None:
        self.gateway = build_cluster_gateway(self.settings, out=open(os.devnull, "w"))  # noqa: SIM115
        self.http = UvicornThread(self.gateway.app, self.port)

    def stop_gateway(self) -> None:
        if self.http is not None:
            self.http.stop()
        if self.gateway is not None:
            self.gateway.close()
        self.http = self.gateway = None

    def close(self) -> None:
        self.stop_gateway()
        if self.scheduler is not None:
            self.scheduler.stop()
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                replica.stop()


def prepared_database(url: str) -> str:
    upgrade_to_head(url)
    return url


# -- private servers ------------------------------------------------------------------------------------
class PrivateRedis:
    """A redis-server of our own: AOF with fsync on every write, so what Redis acknowledged survives a kill."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--logfile", str(self.dir / "log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        wait_until(lambda: _pings(client), 15, "private redis did not start")
        client.close()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


class PrivatePostgres:
    """A PostgreSQL cluster of our own in a temp dir (run as the postgres user: initdb refuses root), made
    with the binaries in `bin_dir` (see `postgres_bin_dir`)."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        # Not under pytest's tmp dir: the postgres user cannot traverse root's private directories.
        self.dir = Path(tempfile.mkdtemp(prefix="carpool-pg-"))
        self.data = self.dir / "pgdata"
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def init(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
        self._pg("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self.start()

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._pg("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.dir / "log"), "-w", "start")

    def stop(self, mode: str = "immediate") -> None:
        """`immediate` is a crash as far as clients can tell; WAL recovery runs on the next start."""
        self._pg("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("fast")
        shutil.rmtree(self.dir, ignore_errors=True)

    def _pg(self, tool: str, *args: str) -> None:
        user = [] if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--"]
        subprocess.run([*user, str(self.bin_dir / tool), *args], check=True, capture_output=True, timeout=60)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


# -- workloads and reference weights ------------------------------------------------------------------------
LEARNING_RATE = 1e-2
RANK = 4


def seed_of(tenant: int) -> int:
    return 100 + tenant


def tenant_batches(tenant: int, steps: int, vocab: int = 512, length: int = 12) -> list[list[np.ndarray]]:
    """Each step's sequences of one tenant (deterministic)."""
    rng = np.random.default_rng(1000 + tenant)
    return [[rng.integers(1, vocab, size=length, dtype=np.int64) for _ in range(2)] for _ in range(steps)]


def domain_datum(tokens: np.ndarray) -> Datum:
    targets = tokens[1:]
    return Datum(tokens[:-1], {"target_tokens": targets, "weights": np.ones(targets.shape, np.float32)})


def reference_weights(model_dir: Path, tenants: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Each tenant trained alone on an in-process engine: what the cluster must reproduce."""
    engine = Engine(model_dir, name=BASE, config=EngineConfig(device="cpu", dtype="float32"))
    weights = []
    for tenant in range(tenants):
        adapter = AdapterId(f"reference-{tenant}")
        engine.create_adapter(adapter, LoraSpec(rank=RANK, seed=seed_of(tenant)))
        for batch in tenant_batches(tenant, steps):
            engine.forward_backward([ForwardBackwardWork(adapter, [domain_datum(t) for t in batch])])
            engine.optim_step(adapter, AdamParams(learning_rate=LEARNING_RATE))
        weights.append({name: p.detach().clone() for name, p in engine.adapter(adapter).params.items()})
    return weights


def saved_weights(database_url: str, data_dir: Path, tinker_path: str) -> dict[str, torch.Tensor]:
    """The factors of a saved checkpoint, keyed like `AdapterState.params`."""
    db = open_database(database_url)
    try:
        with db.sessions.begin() as session:
            row = session.scalars(select(CheckpointRow).where(CheckpointRow.tinker_path == tinker_path)).one()
            uri = row.storage_uri
    finally:
        db.dispose()
    from services.storage import LocalCheckpointStore, UrlSigner

    store = LocalCheckpointStore(data_dir / "checkpoints", UrlSigner(b"0" * 32))
    raw = load_file(str(store.local_path(uri) / "adapter_model.safetensors"))
    return {k.removeprefix("base_model.model.").removesuffix(".weight"): v for k, v in raw.items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_equal_to_reference(database_url: str, data_dir: Path, paths: list[str],
                              expected: list[dict[str, torch.Tensor]], label: str = "") -> None:
    """Each tenant's saved checkpoint (`paths[i]`) equals its solo reference weights to 1e-5."""
    for tenant, path in enumerate(paths):
        difference = max_difference(saved_weights(database_url, data_dir, path), expected[tenant])
        print(f"{label}tenant {tenant}: max |cluster - reference| = {difference:.2e}")
        assert difference <= 1e-5, f"{label}tenant {tenant}"


@contextlib.contextmanager
def scratch_prefix() -> Iterator[str]:
    import uuid

    prefix = f"carpool-cluster-test-{uuid.uuid4().hex[:10]}"
    try:
        yield prefix
    finally:
        wipe_prefix(REDIS_URL, prefix)


# -- SDK clients ----------------------------------------------------------------------------------------------
def create_tenant_keys(database_url: str, count: int, prefix: str = "tenant") -> list[str]:
    from services.auth.tenants import create_tenant_with_key

    db = open_database(database_url)
    try:
        keys = []
        for i in range(count):
            with db.sessions.begin() as session:
                _, issued = create_tenant_with_key(session, f"{prefix}-{i}")
            keys.append(issued.key)
        return keys
    finally:
        db.dispose()


def train_with_sdk(url: str, key: str, tenant: int, steps: int,
                   after_step: Callable[[int, int], None] | None = None, wait_s: float | None = None) -> str:
    """One tenant's whole run through the real SDK; returns the tinker path of its final `save_state`.
    `wait_s`: how long each call's result is waited for (None: for ever), so a stalled run fails."""
    import tinker
    from tinker import types

    # Closed on the way out, as a tenant's script would: its session's heartbeat must not outlive the stack.
    with tinker.ServiceClient(base_url=url, api_key=key) as client:
        training = client.create_lora_training_client(base_model=BASE, rank=RANK, seed=seed_of(tenant)).result()
        for step, batch in enumerate(tenant_batches(tenant, steps)):
            data = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1].tolist()),
                                loss_fn_inputs={"target_tokens": t[1:].tolist(), "weights": [1.0] * (len(t) - 1)})
                    for t in batch]
            fb = training.forward_backward(data, "cross_entropy")
            optim = training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
            assert fb.result(timeout=wait_s).metrics["loss:sum"] > 0
            optim.result(timeout=wait_s)
            if after_step is not None:
                after_step(tenant, step)
        return training.save_state("final").result(timeout=wait_s).path


def train_all(url: str, keys: list[str], steps: int,
              after_step: Callable[[int, int], None] | None = None, wait_s: float | None = None) -> list[str]:
    """Every tenant at once, one thread each; re-raises the first failure (`wait_s`: see `train_with_sdk`)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(keys)) as pool:
        futures = [pool.submit(train_with_sdk, url, key, i, steps, after_step, wait_s)
                   for i, key in enumerate(keys)]
        return [f.result(timeout=600) for f in futures]


class GatewayProcess:
    """`carpool serve --mode cluster` as a subprocess: restartable on its port, killable like a crash."""

    def __init__(self, settings: ClusterSettings, port: int, log_path: Path) -> None:
        self.port = port
        self.log_path = log_path
        self.env = {**os.environ, **settings_env(settings)}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        import sys

        import httpx

        carpool = str(Path(sys.executable).with_name("carpool"))
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen([carpool, "serve", "--mode", "cluster", "--port", str(self.port)],
                                            stdout=log, stderr=subprocess.STDOUT, env=self.env)

        def healthy() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"gateway exited:\n{self.log_path.read_text()}")
            try:
                return is_carpool_health(httpx.get(f"http://127.0.0.1:{self.port}/api/v1/healthz", timeout=2))
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout_s, "cluster gateway did not become healthy")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


def settings_env(settings: ClusterSettings) -> dict[str, str]:
    """The environment that makes a `carpool` process see these settings."""
    env = {
        "CARPOOL_DATA_DIR": str(settings.data_dir), "CARPOOL_BASE_MODELS": ",".join(settings.base_models),
        "CARPOOL_DATABASE_URL": settings.resolved_database_url(), "CARPOOL_REDIS_URL": settings.redis_url,
        "CARPOOL_REDIS_PREFIX": settings.redis_prefix, "CARPOOL_ALLOW_INSECURE_REDIS": "1",
        "CARPOOL_HEARTBEAT_TTL_SECONDS": str(settings.heartbeat_ttl_seconds),
        "CARPOOL_SNAPSHOT_EVERY_STEPS": str(settings.snapshot_every_steps),
        "CARPOOL_BATCH_WINDOW_MS": str(settings.batch_window_ms),
        "CARPOOL_SCHEDULER_LEASE_SECONDS": str(settings.scheduler_lease_seconds),
        "CARPOOL_DEVICE": "cpu", "CARPOOL_DTYPE": "float32", "CARPOOL_SECRET_KEY": TEST_SECRET_KEY,
    }
    return env
