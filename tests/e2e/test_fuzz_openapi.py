"""Schema-driven fuzzing of the served OpenAPI (schemathesis) against a real `carpool serve`.

Schemathesis reads `/openapi.json` from the running server and generates requests for every operation it
describes (the Tinker routes and the `/v1` REST API): valid and invalid bodies, path and query values. The
requests are authenticated as tenant B; about half of the ids they carry (path parameters and id fields of
JSON bodies) are replaced by real ids of tenant A, so the generated traffic also probes isolation. Every
answer must be a non-5xx, of the documented content type, valid against the documented response schema.
Afterwards tenant A still trains and saves normally: nothing B sent disturbed the server or A's runs.

Size: `FUZZ_EXAMPLES` generated cases per operation (default 5: about 375 cases over the ~75 operations,
a minute or two in `make test`; `make fuzz` runs 70 per operation, over 5,000). Excluded: `DELETE
auth/apikey/me` (it revokes the very key the fuzzer uses; tests/e2e/test_security.py covers it).
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
import tinker
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from tests.e2e.server import Server
from tests.e2e.test_security import train_step
from tests.sdk_janitor import close_all

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "5"))
ID_KEYS = ("model_id", "session_id", "request_id", "sampling_session_id", "training_run_id", "sampler_id")
PATH_KEYS = ("tinker_path", "path", "model_path", "source_path")


@pytest.fixture(scope="module")
def alice(server: Server, base_model: str) -> Iterator[tuple[Any, dict[str, str]]]:
    """Tenant A's run and ids, which the fuzzer mixes into tenant B's requests."""
    key = server.create_tenant("fuzz-alice")
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    training = service.create_lora_training_client(base_model=base_model, rank=2).result()
    train_step(training)
    state = training.save_state("fuzz-state").result().path
    model = training.model_id
    assert model is not None
    ids = {"model_id": model, "training_run_id": model, "session_id": model.rsplit(":train:", 1)[0],
           "tinker_path": state, "checkpoint_id": "weights/fuzz-state"}
    yield training, ids
    close_all([service])  # finishes the session: its heartbeat stops


@pytest.fixture(scope="module")
def bob_key(server: Server) -> str:
    return server.create_tenant("fuzz-bob")


def _operations() -> list[Any]:
    """Every operation of the OpenAPI document the gateway serves, built by the same app factory at collection
    time (so each operation is a test id); `test_the_served_document_is_the_one_fuzzed` pins the equality."""
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    app = create_app(GatewaySettings(), object(), object())  # type: ignore[arg-type]
    document = schemathesis.openapi.from_dict(app.openapi())
    operations = [result.ok() for result in document.get_all_operations()]
    return [op for op in operations if op.label not in EXCLUDED]


EXCLUDED = {"DELETE /api/v1/auth/apikey/me"}
OPERATIONS = _operations()
STATUSES: Counter[int] = Counter()
"""Every answer's status, across the module: the summary test checks the fuzzing actually reached the API."""


def test_the_served_document_is_the_one_fuzzed(server: Server) -> None:
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    served = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    local = create_app(GatewaySettings(), object(), object()).openapi()  # type: ignore[arg-type]
    assert set(served["paths"]) == set(local["paths"])
    assert len(OPERATIONS) + len(EXCLUDED) == sum(len(item) for item in served["paths"].values())


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_generated_requests_get_documented_non_5xx_answers(operation: Any, server: Server, bob_key: str,
                                                           alice: tuple[Any, dict[str, str]]) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def exchange(case: Any) -> None:
        _mix_in_foreign_ids(case, alice[1])
        response = case.call(base_url=server.url, headers={"X-API-Key": bob_key}, timeout=60)
        STATUSES[response.status_code] += 1
        assert response.status_code < 500, (case.method, case.formatted_path, response.status_code,
                                            response.text[:500])
        case.validate_response(response, checks=[content_type_conformance, response_schema_conformance])

    exchange()


def test_the_server_still_trains_afterwards(alice: tuple[Any, dict[str, str]]) -> None:
    """Runs last (e2e modules keep file order). Also: the cases reached the API and were not all refused."""
    total = sum(STATUSES.values())

    print(f"schemathesis: {total} cases over {len(OPERATIONS)} operations, statuses {dict(sorted(STATUSES.items()))}")

    if total:  # not when this test is run on its own
        assert total >= len(OPERATIONS) * min(EXAMPLES, 4)
        assert any(200 <= status < 300 for status in STATUSES) and 404 in STATUSES and 400 in STATUSES
    training, _ = alice
    assert train_step(training) > 0
    assert training.save_state("fuzz-after").result().path.endswith("/weights/fuzz-after")


def _mix_in_foreign_ids(case: Any, ids: dict[str, str]) -> None:
    """Replace about half of the case's id values with tenant A's (deterministic per case)."""
    rng = random.Random(repr((case.method, case.path, case.path_parameters, case.body)))
    for key in list(case.path_parameters or {}):
        name = key.split(":")[0]
        if name in ids and rng.random() < 0.5:
            case.path_parameters[key] = ids[name]
    if isinstance(case.body, dict):
        for key in list(case.body):
            if key in ID_KEYS and key in ids and rng.random() < 0.5:
                case.body[key] = ids[key]
            elif key in PATH_KEYS and rng.random() < 0.5:
                case.body[key] = ids["tinker_path"]
