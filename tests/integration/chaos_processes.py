"""The processes of a chaos round, forked from one pre-imported fork server so a restart is cheap.

Each is a real process of its own (SIGKILL kills it as it kills a production one) running a production
entry point with the settings of the round's `CARPOOL_*` environment:

- `scheduler`: `deploy.cluster_up.run_scheduler`, the body of `carpool scheduler --base-model NAME`;
- `gateway`: `deploy.cluster_gateway.serve_cluster_gateway`, the body of `carpool serve --mode cluster`;
- `replica`: a `worker.serve.replica.ReplicaHost`, what Ray Serve hosts per worker replica
  (`worker.serve.app.WorkerDeployment`), without a Ray cluster to start. SIGTERM leaves the membership
  (as Serve's graceful shutdown does); SIGKILL leaves the registration behind, as a crash does.

Why a fork server (`multiprocessing`'s "forkserver" context, preloading torch, the engine and the
gateway): on the shared two-core box one interpreter start with those imports costs ~5 s of CPU, and a
round starts about ten such processes while its tenants train. The fork server is single-threaded and
never runs torch, so forking it is safe; each child builds its own clients, threads and engine.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from multiprocessing.process import BaseProcess
from pathlib import Path

from deploy.settings import ClusterSettings

PRELOAD = ["worker.serve.replica", "deploy.cluster_up", "deploy.cluster_gateway"]
ROLES = ("replica", "scheduler", "gateway")


def start(role: str, env: dict[str, str], log_path: Path) -> BaseProcess:
    """Fork a `role` process (see the module docstring) with exactly `env` as its environment."""
    assert role in ROLES, role
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # takes effect when the fork server first starts
    process = context.Process(target=_main, args=(role, env, str(log_path)), name=f"chaos-{role}", daemon=True)
    process.start()
    return process


def stop_fork_server() -> None:
    """End the fork server (it holds ~400 MB of preloaded modules) once the chaos tests are done with it.
    `_stop` is private, but it is how CPython's own tests end the server; nothing public does."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()


def _main(role: str, env: dict[str, str], log_path: str) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(env)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    settings = ClusterSettings()
    if role == "replica":
        _serve_replica(settings)
    elif role == "scheduler":
        from deploy.cluster_up import run_scheduler

        run_scheduler(settings, settings.served_base_models()[0].name)
    else:
        from deploy.cluster_gateway import serve_cluster_gateway

        serve_cluster_gateway(settings)


def _serve_replica(settings: ClusterSettings) -> None:
    from transformers.utils import logging as transformers_logging

    from deploy.cluster_wiring import cluster_config
    from worker.serve.replica import ReplicaHost

    # tqdm's lock is a multiprocessing semaphore: a replica SIGKILLed after loading would leak one, and
    # the resource tracker would warn about it when the test process exits.
    transformers_logging.disable_progress_bar()
    config = cluster_config(settings)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    host = ReplicaHost(config.base_models[0], config)
    print(f"replica {host.replica_id} serving", flush=True)
    stop.wait()
    host.stop()
