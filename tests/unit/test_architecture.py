"""The layering rules of DEVELOPERS.md, checked in the suite: import-linter contracts and module size caps."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "gateway", "worker", "deploy")


def test_import_linter_contracts_hold() -> None:
    linter = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(linter), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "broken" in proc.stdout and " 0 broken" in proc.stdout, proc.stdout


def parse(source: str) -> ast.Module:
    """`ast.parse`, once more when CPython before 3.11.8 trips over another thread's parse: its AST converter
    shares one recursion counter between threads (cpython#106905), and on 3.11 every formatted traceback parses
    source (the carets), so a background thread logging a failure can make this parse raise SystemError."""
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)


def test_modules_stay_under_the_size_cap_and_have_docstrings() -> None:
    problems = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            source = path.read_text()
            tree = parse(source)
            if source.count("\n") > 800:
                problems.append(f"{path.relative_to(ROOT)}: over 800 lines")
            if source.strip() and ast.get_docstring(tree) is None:
                problems.append(f"{path.relative_to(ROOT)}: no module docstring")
    assert not problems, "\n".join(problems)
