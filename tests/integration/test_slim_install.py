"""The base install (no `worker` extra) runs the gateway, the schedulers and the hub worker without torch, peft,
ray or CUDA: the slim image's contents, built here as a fresh venv from the project's files.

The venv is made like deploy/docker/Dockerfile.gateway makes it (a regular install of a copy of the sources,
migrations found through CARPOOL_MIGRATIONS_DIR); pip's cache keeps it to about a minute. Then, against the
local PostgreSQL and Redis: `carpool migrate --check` refuses an unmigrated database, `carpool migrate`
migrates it, the cluster gateway answers /api/v1/healthz, and a scheduler takes its base model's lease.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TypeVar

import pytest
import redis

from services.db.testing import scratch_postgres_database
from services.domain.backend import BaseModelInfo
from services.domain.validation import ModelLimits
from services.runtime.redis_replicas import ClusterKeys
from services.runtime.replica_protocol import PublishedModel
from tests.e2e.server import free_port

# Building the venv takes one to four minutes on two busy cores (resolution and unpacking, pip's cache warm):
# `slow`, so `make test-fast` leaves it out; `make test` and CI run it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "services", "gateway", "worker", "deploy")
HEAVY = ("torch", "transformers", "peft", "ray", "gguf")
NOT_INSTALLED = ("torch", "peft", "ray", "gguf")
MODEL = "slim/test-model"
REDIS_URL = "redis://127.0.0.1:6379/0"
START_WAIT_S = 120.0
T = TypeVar("T")


@pytest.fixture(scope="module")
def slim_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding `pip install <copy of the sources>`: the base dependencies only."""
    root = tmp_path_factory.mktemp("slim")
    source = root / "src"
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, source / name)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", "--disable-pip-version-check",
                              str(source)],
                             capture_output=True, text=True, timeout=840)
    assert install.returncode == 0, install.stdout[-4000:] + install.stderr[-4000:]
    return venv


def _python(venv: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=venv.parent)  # not the checkout: its packages must not shadow the installed ones


def test_the_base_install_has_no_worker_dependencies(slim_venv: Path) -> None:
    code = f"import importlib.util as u, json; print(json.dumps({{n: bool(u.find_spec(n)) for n in {NOT_INSTALLED}}}))"
    probe = _python(slim_venv, code)
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout) == dict.fromkeys(NOT_INSTALLED, False)


def test_gateway_scheduler_and_hub_worker_import_no_tensor_framework(slim_venv: Path) -> None:
    modules = ["deploy.cli", "deploy.cluster_gateway", "deploy.scheduler_service", "deploy.hub_commands",
               "deploy.hub_wiring", "deploy.schema_check", "gateway.app"]
    code = ("import importlib, json, sys; "
            f"[importlib.import_module(m) for m in {modules!r}]; "
            "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))")
    probe = _python(slim_venv, code)
    assert probe.returncode == 0, probe.stderr
    loaded = set(json.loads(probe.stdout))
    assert loaded.isdisjoint(HEAVY), loaded & set(HEAVY)


@pytest.fixture
def cluster_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    prefix = f"slim-{secrets.token_hex(4)}"
    with scratch_postgres_database(prefix="carpool_slim") as database_url:
        env = {**os.environ,
               "CARPOOL_DATABASE_URL": database_url, "CARPOOL_REDIS_URL": REDIS_URL, "CARPOOL_REDIS_PREFIX": prefix,
               "CARPOOL_ALLOW_INSECURE_REDIS": "true", "CARPOOL_SECRET_KEY": secrets.token_urlsafe(32),
               "CARPOOL_BASE_MODELS": f"{MODEL}=/models/none", "CARPOOL_DATA_DIR": str(tmp_path / "data"),
               "CARPOOL_MIGRATIONS_DIR": str(ROOT / "migrations"), "CARPOOL_MODEL_INFO_WAIT_SECONDS": "120",
               "CARPOOL_HOST": "127.0.0.1"}
        client = redis.Redis.from_url(REDIS_URL)
        try:
            yield env
        finally:
            keys = list(client.scan_iter(match=f"{prefix}:*"))
            if keys:
                client.delete(*keys)
            client.close()


def _carpool(venv: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "carpool"), *args], env=env, capture_output=True, text=True,
                          timeout=180, cwd=venv.parent)


def test_migrate_check_then_gateway_and_scheduler_start_without_torch(slim_venv: Path,
                                                                     cluster_env: dict[str, str]) -> None:
    unmigrated = _carpool(slim_venv, cluster_env, "migrate", "--check")
    assert unmigrated.returncode == 1 and "carpool migrate" in unmigrated.stdout + unmigrated.stderr
    migrated = _carpool(slim_venv, cluster_env, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    current = _carpool(slim_venv, cluster_env, "migrate", "--check")
    assert current.returncode == 0, current.stderr

    # What a worker replica publishes once its model is loaded; the gateway waits for it before serving.
    info = BaseModelInfo(MODEL, "qwen3", 512, 2048, "/models/none", (0,))
    client = redis.Redis.from_url(REDIS_URL)
    keys = ClusterKeys(MODEL, cluster_env["CARPOOL_REDIS_PREFIX"])
    client.set(keys.model_info, PublishedModel(info, ModelLimits(512, 2048, 8192)).to_json())

    port = free_port()
    gateway = _start(slim_venv, cluster_env, "serve", "--mode", "cluster", "--port", str(port))
    scheduler = _start(slim_venv, {**cluster_env, "CARPOOL_METRICS_PORT": str(free_port())},
                       "scheduler", "--base-model", MODEL)
    try:
        health = _wait_for(lambda: _healthz(port), gateway)
        assert health is not None and health["status"] == 200, _output(gateway)
        holder = _wait_for(lambda: client.get(keys.lease), scheduler)
        assert holder is not None and holder.decode().startswith("scheduler@"), _output(scheduler)
    finally:
        for process in (gateway, scheduler):
            _stop(process)
        client.close()

    for command in (("scheduler", "--help"), ("hub-worker", "--help")):
        shown = _carpool(slim_venv, cluster_env, *command)
        assert shown.returncode == 0 and "Usage" in shown.stdout, shown.stderr


def _start(venv: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """The process with its output in a file (a pipe nobody reads could fill and stall it)."""
    log: IO[str] = open(Path(env["CARPOOL_DATA_DIR"]).parent / f"{args[0]}-{secrets.token_hex(3)}.log", "w+")  # noqa: SIM115
    return subprocess.Popen([str(venv / "bin" / "carpool"), *args], env=env, cwd=venv.parent, text=True,
                            stdout=log, stderr=subprocess.STDOUT)


def _healthz(port: int) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=5) as response:
            return {"status": response.status, "body": response.read().decode()}
    except OSError:
        return None


def _wait_for(probe: Callable[[], T | None], process: subprocess.Popen[str]) -> T | None:
    """Poll `probe` until it answers or the process exits; bounded by START_WAIT_S (not a timing assertion)."""
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline and process.poll() is None:
        found = probe()
        if found is not None:
            return found
        time.sleep(0.5)
    return probe()


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def _output(process: subprocess.Popen[str]) -> str:
    _stop(process)
    if process.stdout is None:
        return ""
    process.stdout.seek(0)
    return process.stdout.read()[-4000:]
