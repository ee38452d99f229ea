"""The leftover-process report finds a child of this run still alive, and not this process or its parents."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.leftovers import leftover_processes


def test_a_live_child_is_listed_and_this_process_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pids = dict(leftover_processes())
        assert child.pid in pids and "time.sleep(30)" in pids[child.pid]
        assert os.getpid() not in pids and os.getppid() not in pids
    finally:
        child.kill()
        child.wait()
    assert child.pid not in dict(leftover_processes())
