"""Clients we did not write: older JSON-era `tinker` releases against today's `carpool serve`.

Each SDK version gets its own virtual environment under `.cache/sdk-tinker-<version>` (built on first use
with pip, which reuses its download cache; later runs reuse the environment), so the project's own
`tinker` 0.38 is untouched. `old_sdk_smoke.py` runs in that interpreter: four training steps (the loss
falls), a `save_state`, sampling from the trained weights. 0.24.1 is the last release that sends legacy
JSON `forward_backward` bodies and reads JSON results (docs/api.md); 0.38 runs the same script as a control.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server import Server

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("old_sdk_smoke.py")
VERSIONS = ["0.24.1", "0.38.0"]


def sdk_python(version: str) -> str:
    """An interpreter with exactly `tinker==version` (the project's own for the version it pins)."""
    import tinker

    if tinker.__version__ == version:
        return sys.executable
    venv = ROOT / ".cache" / f"sdk-tinker-{version}"
    python = venv / "bin" / "python"
    if not python.exists() or _version(python) != version:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"tinker=={version}"], check=True, timeout=900)
    return str(python)


def _version(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import tinker; print(tinker.__version__)"], capture_output=True,
                         text=True, timeout=120)
    return out.stdout.strip()


@pytest.mark.parametrize("version", VERSIONS)
def test_an_sdk_release_trains_saves_and_samples(version: str, server: Server, base_model: str) -> None:
    python = sdk_python(version)
    key = server.create_tenant(f"sdk-{version.replace('.', '-')}")
    out = subprocess.run([python, str(SCRIPT), server.url, key, base_model], capture_output=True, text=True,
                         timeout=600, env={"TINKER_TELEMETRY": "0", "PATH": "/usr/bin:/bin",
                                           "HOME": str(Path.home())})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["version"] == version
    losses = result["losses"]
    assert losses[-1] < losses[0], losses
    assert result["path"].startswith("tinker://") and result["path"].endswith("/weights/old-sdk-state")
    assert len(result["samples"]) == 2 and all(1 <= len(s) <= 4 for s in result["samples"])
