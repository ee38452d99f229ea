"""Fixtures of the browser tests: one `carpool serve` and one Chromium (Debian's, through Playwright) per module.

Chromium is Debian's package (`apt-get install chromium`, done by `.ci/services` under `make test`), launched
by path; Playwright's own browser downloads are never used. Screenshots land in `tests/browser/artifacts/`
(git-ignored), one per page, for a human to look at after a run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server import Server, start_server
from tests.required import require_binary

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
ARTIFACTS = Path(__file__).with_name("artifacts")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from worker.models.devmodel import build_dev_model

    model = build_dev_model(tmp_path_factory.mktemp("browser-model"), layers=2, hidden=64, vocab=512, seed=0)
    srv = start_server(tmp_path_factory.mktemp("browser-data"), model, mode="embedded")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = require_binary("chromium", "chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
