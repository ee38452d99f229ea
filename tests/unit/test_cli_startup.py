"""The `carpool` CLI starts without the service: loading it imports no tensor, web, Ray or SDK framework.

Every admin command (`carpool tenants create`, `carpool keys revoke`, ...) is a new process. When the CLI's
modules imported `deploy.embedded` at load time, each such command pulled in the control plane, the wire
schema, the `tinker` SDK and through it torch: 5.3 s before `--help` printed on the development box,
1.4 s without them. The commands that need those import them inside (`serve`, `worker`, `dev-model`, ...).
"""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "peft", "tinker", "ray", "fastapi", "uvicorn", "celery", "boto3")


def _imported_after(statement: str) -> list[str]:
    probe = f"{statement}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def test_loading_the_cli_imports_no_framework() -> None:
    assert _imported_after("import deploy.cli") == []


def test_every_command_module_loads_light() -> None:
    # The modules `deploy.cli` registers commands from; each is imported by the CLI at start.
    modules = ["deploy.commands", "deploy.cluster_commands", "deploy.hub_commands", "deploy.storage_commands",
               "deploy.options"]
    assert _imported_after("\n".join(f"import {m}" for m in modules)) == []
