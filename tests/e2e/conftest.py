"""Fixtures for the end-to-end suites: one `carpool serve` subprocess per module, real SDK clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server import TINY_MODEL_NAME, Server, start_server


@pytest.fixture(scope="session")
def e2e_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen3 (hidden 64, vocab 512) with a local tokenizer and chat template."""
    from worker.models.devmodel import build_dev_model

    return build_dev_model(tmp_path_factory.mktemp("e2e-model"), layers=2, hidden=64, vocab=512, seed=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, e2e_model_dir: Path) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("carpool-data"), e2e_model_dir)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def base_model() -> str:
    return TINY_MODEL_NAME
