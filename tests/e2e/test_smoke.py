"""The smallest end-to-end checks: the real SDK creates a model on `carpool serve` and trains one step, and its
telemetry reaches the server."""

from __future__ import annotations

import re

import httpx
import pytest
import tinker
from tinker import types

from tests.e2e.server import Server


def test_sdk_trains_one_step(server: Server, base_model: str) -> None:
    key = server.create_tenant("smoke")
    client = tinker.ServiceClient(base_url=server.url, api_key=key)
    training = client.create_lora_training_client(base_model=base_model, rank=4).result()
    tokens = [1, 5, 9, 13, 17, 21]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    out = training.forward_backward([datum], "cross_entropy").result()
    assert out.metrics["loss:sum"] > 0
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert key not in server.log()


def test_sdk_telemetry_reaches_the_server(server: Server, base_model: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's own telemetry (on for its users by default) is accepted: leaving the `with` block closes the
    client, which flushes its batch, and the gateway answers it 200, never 4xx. The suite turns telemetry
    off everywhere else (tests/conftest.py), so this test is what sends `POST /api/v1/telemetry` from the
    real SDK."""
    monkeypatch.setenv("TINKER_TELEMETRY", "1")  # read when a client is made
    before = _telemetry_answers(server)
    with tinker.ServiceClient(base_url=server.url, api_key=server.create_tenant("telemetry")) as client:
        client.create_lora_training_client(base_model=base_model, rank=4)  # starts the session it reports
    after = _telemetry_answers(server)
    assert after.get("200", 0) > before.get("200", 0), (before, after)
    refused_before = {status: n for status, n in before.items() if not status.startswith("2")}
    assert {status: n for status, n in after.items() if not status.startswith("2")} == refused_before, after


def _telemetry_answers(server: Server) -> dict[str, int]:
    """`POST /api/v1/telemetry` answers so far, by status, from the gateway's /metrics."""
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    pattern = r'carpool_http_requests_total\{([^}]*)\} ([0-9.e+]+)'
    answers: dict[str, int] = {}
    for labels, value in re.findall(pattern, metrics):
        if 'route="/api/v1/telemetry"' in labels and 'method="POST"' in labels:
            status = re.search(r'status="(\d+)"', labels)
            answers[status.group(1) if status else "?"] = int(float(value))
    return answers
