"""The container images' build files: hadolint-clean, multi-stage, pinned bases, non-root, a HEALTHCHECK that
asks whichever Carpool process the container runs, and a .dockerignore that keeps the context small."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("Dockerfile.*"))


def _script(path: Path) -> ModuleType:
    """healthcheck.py ships as a script in the images, not as a module of the package."""
    spec = importlib.util.spec_from_file_location("carpool_image_healthcheck", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = _script(ROOT / "deploy" / "docker" / "healthcheck.py")


def test_both_images_exist() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.gateway", "Dockerfile.worker"]


def test_hadolint_is_clean() -> None:
    run = subprocess.run([str(Path(sys.executable).parent / "hadolint"), *map(str, DOCKERFILES)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_pinned_non_root_with_healthcheck(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    bases = dict(re.findall(r"^ARG (\w+_IMAGE)=(\S+)$", text, re.M))
    assert bases and all(re.search(r":\d+(\.\d+)+", image) for image in bases.values()), bases
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*healthcheck\.py", text, re.M)
    assert "CARPOOL_MIGRATIONS_DIR=/opt/carpool/migrations" in text and "COPY migrations" in text


def test_the_slim_image_installs_no_worker_extra_and_the_worker_image_does() -> None:
    gateway = (ROOT / "deploy" / "docker" / "Dockerfile.gateway").read_text()
    worker = (ROOT / "deploy" / "docker" / "Dockerfile.worker").read_text()
    assert "[worker]" not in gateway and "torch" not in gateway.replace("no torch", "")
    assert '"/src[worker]"' in worker and "torch==" in worker


def test_dockerignore_keeps_only_what_the_images_copy() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[0].startswith("#") and "**" in ignore
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert kept == {"pyproject.toml", "README.md", "LICENSE", "services", "gateway", "worker", "deploy", "migrations"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_images_copy_the_files_the_package_build_reads(dockerfile: Path) -> None:
    """`pip install /src` builds the package from pyproject.toml, which names its readme and license files: a
    file missing from the build stage fails the image's build."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {"pyproject.toml", project["readme"], *project["license-files"]}
    lines = dockerfile.read_text().splitlines()
    copies = [line.split()[1:-1] for line in lines if line.startswith("COPY pyproject.toml")]
    assert len(copies) == 1 and needed <= set(copies[0])


@pytest.mark.parametrize(("argv", "url"), [
    (["/opt/carpool/bin/python", "/opt/carpool/bin/carpool", "serve", "--mode", "cluster"],
     "http://127.0.0.1:8000/api/v1/healthz"),
    (["carpool", "scheduler", "--base-model", "m"], "http://127.0.0.1:9090/metrics"),
    (["carpool", "worker"], healthcheck.RAYLET_HEALTH),
    (["/bin/bash", "-lc", "--", "ulimit -n 65536; ray start --head --block"], healthcheck.RAYLET_HEALTH),
    (["carpool", "migrate"], None),
])
def test_healthcheck_asks_the_process_the_container_runs(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                         url: str | None) -> None:
    monkeypatch.setenv("CARPOOL_METRICS_PORT", "9090")
    monkeypatch.delenv("CARPOOL_PORT", raising=False)
    assert healthcheck.health_url(argv) == url


def test_healthcheck_fails_when_nothing_answers() -> None:
    assert healthcheck.healthy(None) is True
    assert healthcheck.healthy("http://127.0.0.1:9/api/v1/healthz") is False
