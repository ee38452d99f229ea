"""What the chart relies on in the composition root: the Serve application builder's arguments,
`carpool migrate --check`, and the hub worker's heartbeat file."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from typer.testing import CliRunner

from deploy.cli import app as cli
from deploy.hub_heartbeat import install_heartbeat
from deploy.serve_app import WorkerArgsError, worker_config
from deploy.settings import ClusterSettings

WAIT_S = 30.0


def _settings(tmp_path: Path) -> ClusterSettings:
    return ClusterSettings(data_dir=tmp_path, redis_url="redis://redis:6379/0", redis_prefix="prod", replicas=1)


def test_worker_config_takes_the_model_and_its_resources_from_args(tmp_path: Path) -> None:
    config = worker_config({"base_model": "org/m", "source": "hf://org/m", "replicas": 3, "num_gpus": 1,
                            "num_cpus": "2"}, _settings(tmp_path))
    (spec,) = config.base_models
    assert (spec.name, spec.source, spec.replicas, spec.num_gpus, spec.num_cpus) == ("org/m", "hf://org/m", 3, 1, 2)
    assert (config.redis_url, config.prefix, config.data_dir) == ("redis://redis:6379/0", "prod", str(tmp_path))


@pytest.mark.parametrize(("args", "message"), [
    ({"source": "x"}, "base_model"),
    ({"base_model": "m", "source": "x", "replicas": 0}, "replicas must be >= 1"),
    ({"base_model": "m", "source": "x", "num_gpus": "one"}, "num_gpus must be a number"),
])
def test_worker_config_names_the_bad_arg(tmp_path: Path, args: dict[str, object], message: str) -> None:
    with pytest.raises(WorkerArgsError, match=message):
        worker_config(args, _settings(tmp_path))


def test_migrate_check_fails_until_migrated(tmp_path: Path) -> None:
    runner = CliRunner()
    options = ["--data-dir", str(tmp_path)]
    before = runner.invoke(cli, ["migrate", "--check", *options])
    assert before.exit_code == 1 and "carpool migrate" in before.output
    assert runner.invoke(cli, ["migrate", *options]).exit_code == 0
    after = runner.invoke(cli, ["migrate", "--check", *options])
    assert after.exit_code == 0 and "current" in after.output


def test_hub_worker_heartbeat_stays_fresh_while_the_worker_runs_and_goes_when_it_stops(tmp_path: Path) -> None:
    heartbeat = tmp_path / "hub" / "heartbeat"
    app = Celery("heartbeat-test", broker="memory://", backend="cache+memory://")
    install_heartbeat(app, heartbeat, every_s=0.2)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        assert _eventually(heartbeat.exists)
        first = heartbeat.stat().st_mtime_ns
        assert _eventually(lambda: heartbeat.stat().st_mtime_ns != first), "the heartbeat was not refreshed"
    assert not heartbeat.exists()


def test_no_heartbeat_path_adds_no_step() -> None:
    app = Celery("no-heartbeat", broker="memory://")
    before = set(app.steps["worker"])
    install_heartbeat(app, None)
    assert set(app.steps["worker"]) == before


def _eventually(check: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())
