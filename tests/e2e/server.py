"""A real `carpool serve` subprocess on a free port, and tenants created through the real CLI.

The e2e suites drive it with the unmodified `tinker` SDK over HTTP, exactly as a user would. The
server runs on a tiny random-weight dev model (no hub) so the suites stay fast on two cores.

Two modes: `embedded` (`carpool serve`, everything in one process, SQLite) and `cluster` (`carpool
cluster up`: Ray Serve worker, scheduler service and gateway over PostgreSQL and Redis; see
`tests/e2e/cluster_mode.py`). `start_server` uses `default_mode()` unless told otherwise; the e2e
conftest sets it per module (`CARPOOL_E2E_MODES`, `CARPOOL_E2E_CLUSTER_MODULES`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

CARPOOL = str(Path(sys.executable).with_name("carpool"))
TINY_MODEL_NAME = "carpool/tiny-qwen3"
SMOLLM2_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The real model the slow suites serve (`smollm2_server`, the cookbook)."""
MODES = ("embedded", "cluster")
_mode = ["embedded"]


def default_mode() -> str:
    return _mode[0]


def set_default_mode(mode: str) -> None:
    """The mode `start_server` uses when not told (the e2e conftest sets it per module)."""
    if mode not in MODES:
        raise ValueError(f"unknown e2e mode {mode!r}; one of {MODES}")
    _mode[0] = mode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A running server: its URL, data dir, admin key, log file and process."""

    url: str
    data_dir: Path
    admin_key: str
    log_path: Path
    process: subprocess.Popen[bytes]
    env: dict[str, str] = field(default_factory=dict)
    mode: str = "embedded"
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def cli(self, *args: str) -> str:
        """Run a `carpool` admin command against this server's state; returns stdout."""
        proc = subprocess.run([CARPOOL, *args, "--data-dir", str(self.data_dir)], env=self.env,
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"carpool {' '.join(args)} failed: {proc.stderr}")
        return proc.stdout

    def create_tenant(self, name: str) -> str:
        """A new tenant's API key (the last line of `carpool tenants create`)."""
        return self.cli("tenants", "create", name).strip().splitlines()[-1]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20 if self.mode == "embedded" else 90)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        while self.cleanups:
            self.cleanups.pop()()


def start_server(data_dir: Path, model_dir: Path | None = None, *, extra_env: dict[str, str] | None = None,
                 timeout_s: float = 180.0, base_model_spec: str | None = None, mode: str | None = None) -> Server:
    """Start `carpool serve` serving `model_dir` as TINY_MODEL_NAME (or `base_model_spec`, a `NAME=SOURCE`
    such as `HuggingFaceTB/SmolLM2-135M-Instruct=smollm2-135m`); wait until /api/v1/healthz answers.
    `mode` (default: `default_mode()`) picks `carpool serve` or `carpool cluster up`."""
    if base_model_spec is None:
        if model_dir is None:
            raise ValueError("start_server needs model_dir or base_model_spec")
        base_model_spec = f"{TINY_MODEL_NAME}={model_dir}"
    mode = mode or default_mode()
    for attempt in range(3):
        try:
            return _start_once(data_dir, base_model_spec, extra_env, timeout_s, mode)
        except PortTaken:
            if attempt == 2:
                raise
            shutil.rmtree(data_dir, ignore_errors=True)  # a fresh start: nothing was served from it
    raise AssertionError("unreachable")


class PortTaken(RuntimeError):
    """The server could not bind the port `free_port()` chose: another process took it meanwhile."""


def _start_once(data_dir: Path, base_model_spec: str, extra_env: dict[str, str] | None, timeout_s: float,
                mode: str) -> Server:
    port = free_port()
    args, mode_env, cleanups = ["serve", "--port", str(port), "--base-model", base_model_spec], {}, []
    if mode == "cluster":
        from tests.e2e.cluster_mode import cluster_launch

        args, mode_env, cleanups = cluster_launch(port, base_model_spec)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CARPOOL_DATA_DIR": str(data_dir),
           **mode_env, **(extra_env or {})}
    log_path = data_dir / "server.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen([CARPOOL, *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    server = Server(url=url, data_dir=data_dir, admin_key="", log_path=log_path, process=process, env=env,
                    mode=mode, cleanups=cleanups)
    try:
        _wait_healthy(url, process, log_path, timeout_s)
    except BaseException:
        server.stop()
        raise
    server.admin_key = _admin_key(log_path)
    return server


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            text = log_path.read_text(errors="replace")
            if "address already in use" in text.lower():
                raise PortTaken(f"carpool serve could not bind its port:\n{text}")
            raise RuntimeError(f"carpool serve exited with {process.returncode}:\n{text}")
        try:
            if is_carpool_health(httpx.get(f"{url}/api/v1/healthz", timeout=2)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    process.kill()
    raise RuntimeError(f"carpool serve not healthy after {timeout_s}s:\n{log_path.read_text()}")


def is_carpool_health(response: httpx.Response) -> bool:
    """Our healthz answer, not just any 200: between `free_port()` and the gateway's bind (a cluster first
    starts Ray, tens of seconds) another process may take the port — Ray's own Prometheus exporter binds
    random ports and answers every GET with 200 — and a test must not talk to it."""
    if response.status_code != 200:
        return False
    try:
        return bool(response.json() == {"status": "ok"})
    except ValueError:
        return False


def _admin_key(log_path: Path) -> str:
    for line in log_path.read_text().splitlines():
        for word in line.split():
            if word.startswith("tml-") and len(word) > 40:
                return word
    return ""
