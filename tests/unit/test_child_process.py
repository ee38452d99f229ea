"""`cluster up`'s child processes: the environment they get, the scheduler children of
`CARPOOL_SCHEDULER_PROCESSES`, and stopping (SIGTERM, then SIGKILL after the timeout). The children running
the real `carpool scheduler` are exercised end to end by `tests/e2e/test_multi_tenant.py` in cluster mode."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from deploy.child_process import ChildProcess, child_env
from deploy.cluster_up import scheduler_children
from deploy.cluster_wiring import cluster_config
from deploy.settings import ClusterSettings


def _settings(tmp_path: Path, **overrides: object) -> ClusterSettings:
    models = ["first=/models/a", "second=/models/b,with-comma"]
    return ClusterSettings(data_dir=tmp_path / "data", base_models=models,  # type: ignore[arg-type]
                           database_url="postgresql+psycopg://postgres@127.0.0.1:5432/resolved", **overrides)


def test_a_child_gets_what_cluster_up_resolved_but_not_the_gateways_metrics_port(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    env = child_env(settings, {"CARPOOL_METRICS_PORT": "9090", "PATH": "/bin", "CARPOOL_SECRET_KEY": "k"})
    assert "CARPOOL_METRICS_PORT" not in env and env["PATH"] == "/bin" and env["CARPOOL_SECRET_KEY"] == "k"
    assert env["CARPOOL_DATABASE_URL"] == settings.database_url
    assert env["CARPOOL_DATA_DIR"] == str(tmp_path / "data")
    # The base models given as --base-model reach the child intact (JSON: a source may hold a comma).
    assert json.loads(env["CARPOOL_BASE_MODELS"]) == settings.base_models
    assert ClusterSettings(base_models=env["CARPOOL_BASE_MODELS"]).base_models == settings.base_models


def test_scheduler_processes_are_one_carpool_scheduler_per_base_model_with_consecutive_metrics_ports(
        tmp_path: Path) -> None:
    settings = _settings(tmp_path, scheduler_processes=True, scheduler_metrics_port=9100)
    children = scheduler_children(settings, cluster_config(settings))
    assert [c.name for c in children] == ["scheduler of first", "scheduler of second"]
    for index, (child, name) in enumerate(zip(children, ("first", "second"), strict=True)):
        assert child._command[-3:] == ["scheduler", "--base-model", name]  # noqa: SLF001
        assert child._command[:3] == [sys.executable, "-m", "deploy.cli"]  # noqa: SLF001
        assert child._env["CARPOOL_METRICS_PORT"] == str(9100 + index)  # noqa: SLF001
    unported = scheduler_children(_settings(tmp_path, scheduler_processes=True), cluster_config(settings))
    assert all("CARPOOL_METRICS_PORT" not in c._env for c in unported)  # noqa: SLF001


def _child(tmp_path: Path, code: str, timeout_s: float) -> ChildProcess:
    return ChildProcess("probe", [sys.executable, "-c", code], dict(os.environ), log_file=tmp_path / "child.log",
                        stop_timeout_s=timeout_s)


def test_stop_terminates_a_child_and_reaps_it(tmp_path: Path) -> None:
    child = _child(tmp_path, "import time; print('up', flush=True); time.sleep(120)", timeout_s=20)
    child.start()
    pid = child.pid
    assert child.running and pid is not None
    assert child.stop() == -signal.SIGTERM
    assert not child.running and child.pid is None and child.stop() is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not a zombie


def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
            "time.sleep(120)")
    child = _child(tmp_path, code, timeout_s=1)
    child.start()
    for _ in range(200):  # wait until the handler is installed (it prints after)
        if "up" in (tmp_path / "child.log").read_text():
            break
        time.sleep(0.05)
    assert child.stop() == -signal.SIGKILL  # SIGTERM was ignored: killed once the timeout passed
