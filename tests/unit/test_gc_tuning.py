"""`deploy/gc_tuning.py`: a serving process freezes its startup heap and runs full collections far less often.

Counted, not timed: the same allocation pattern (objects that outlive the young collections, as a waiting
request's do) runs in a fresh interpreter with and without the tuning, and a gc callback counts full
collections and the objects each one had to traverse.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

WORKLOAD = """
import collections, gc, json, sys
tuned = sys.argv[1] == "tuned"
startup = [[i] for i in range(200_000)]  # what startup leaves alive for ever (modules, the app, the model)
if tuned:
    from deploy.gc_tuning import tune_collector
    tune_collector()
full = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2
                    and full.append(len(gc.get_objects(generation=2))))
window = collections.deque(maxlen=20)  # requests in flight: each lives through many young collections
for i in range(2_000):
    window.append([[j] for j in range(1_000)])  # a burst of requests arrives; the oldest burst finishes
print(json.dumps({"full": len(full), "traversed": sum(full), "frozen": gc.get_freeze_count(),
                  "threshold": gc.get_threshold()}))
"""


def _run(mode: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", WORKLOAD, mode], capture_output=True, text=True, check=True,
                         timeout=120)
    return json.loads(out.stdout)


def test_tuning_freezes_startup_objects_and_spaces_out_full_collections() -> None:
    plain, tuned = _run("plain"), _run("tuned")
    assert tuned["frozen"] >= 200_000 and plain["frozen"] == 0
    assert tuned["threshold"][2] == 100
    assert plain["full"] >= 5
    assert tuned["full"] * 5 <= plain["full"]
    assert tuned["traversed"] * 20 <= plain["traversed"]


def test_serve_tunes_the_collector_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    import deploy.embedded as embedded

    calls: list[str] = []

    class Service:
        engines: dict[str, object] = {}

        def start(self) -> None:
            calls.append("start")

        def stop(self) -> None:
            calls.append("stop")

    monkeypatch.setattr(embedded, "build_embedded", lambda settings: Service())
    monkeypatch.setattr(embedded, "build_gateway_app", lambda settings, service: object())
    monkeypatch.setattr(embedded, "install_key_redaction", lambda: None)
    monkeypatch.setattr(embedded, "tune_collector", lambda: calls.append("tune"))
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: calls.append("serve"))
    settings = type("Settings", (), {"log_level": "warning", "host": "127.0.0.1", "port": 0, "access_log": False,
                                     "http_keep_alive_seconds": 5})()
    embedded.serve(settings)  # type: ignore[arg-type]
    assert calls == ["start", "tune", "serve", "stop"]
