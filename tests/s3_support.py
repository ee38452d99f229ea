"""A real S3 HTTP server for tests: `moto_server` on 127.0.0.1 (a free port), one per test session.

No in-process patching of boto3: the store talks HTTP to the server exactly as it would to AWS or MinIO.
Credentials go through the standard AWS chain (environment variables), as in production. Each test gets
its own bucket (`s3_bucket`), so tests never see each other's objects. `S3Server.stop()`/`start()` take the
server down and back up on the same port (for the "S3 down during a save" tests).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.storage.s3 import S3CheckpointStore, build_s3_store

_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "carpool-test", "AWS_SECRET_ACCESS_KEY": "carpool-test-secret",
                "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _moto_binary() -> str:
    beside = Path(sys.executable).with_name("moto_server")
    found = str(beside) if beside.exists() else shutil.which("moto_server")
    if found is None:
        pytest.fail("moto_server is not installed: pip install 'moto[server]' (the dev extra)")
    return found


@dataclass
class S3Server:
    """A `moto_server` process; `url` is its endpoint."""

    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen([_moto_binary(), "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(300):
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.process.poll() is not None:
                    pytest.fail(f"moto_server exited with {self.process.returncode}")
                time.sleep(0.05)
        pytest.fail("moto_server did not start listening")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


def s3_client(endpoint: str):  # noqa: ANN201 - boto3 clients have no static type
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=endpoint)


def make_bucket(server: S3Server) -> str:
    name = f"carpool-{uuid.uuid4().hex[:12]}"
    s3_client(server.url).create_bucket(Bucket=name)
    return name


def make_store(server: S3Server, bucket: str, cache_dir: Path, *, cache_max_bytes: int = 1 << 30,
               prefix: str = "ckpt", **kwargs: object) -> S3CheckpointStore:
    return build_s3_store(f"s3://{bucket}/{prefix}", cache_dir=cache_dir, cache_max_bytes=cache_max_bytes,
                          endpoint_url=server.url, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    for key, value in _CREDENTIALS.items():
        os.environ.setdefault(key, value)
    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    return make_bucket(s3_server)
