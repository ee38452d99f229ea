"""Reports the processes a test run leaves behind: those of the run's session (`os.getsid`) that are neither
this process nor one of its ancestors, listed in the terminal summary.

Why: a CI run printed a tinker SDK heartbeat failure after pytest's summary (a client of a server already
gone, 13 minutes old), yet the pytest process held no open client at exit. So some test's child process
outlived it. The list names such processes by command line, so the next run shows which test to fix. It
does not fail the run: services the run started on purpose (PostgreSQL, Redis when `.ci/services` started
them) belong to the session too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of `pid`, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[3])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def leftover_processes() -> list[tuple[int, str]]:
    """(pid, command line) of the other processes in this process's session, its ancestors left out."""
    if not Path("/proc").is_dir():
        return []
    ancestors, pid = set(), os.getpid()
    while pid > 1 and pid not in ancestors:
        ancestors.add(pid)
        stat = _stat(pid)
        pid = stat[0] if stat else 0
    sid = os.getsid(0)
    found = []
    for pid in (int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()):
        stat = None if pid in ancestors else _stat(pid)
        if stat is not None and stat[1] == sid:
            found.append((pid, _cmdline(pid)))
    return sorted(found)


class LeftoverReport:
    """A pytest plugin: the terminal summary lists `leftover_processes()` when there are any."""

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        leftovers = leftover_processes()
        if leftovers:
            terminalreporter.section("processes of this run still alive (informational)", yellow=True)
            for pid, cmdline in leftovers:
                terminalreporter.line(f"{pid}: {cmdline[:300]}")
