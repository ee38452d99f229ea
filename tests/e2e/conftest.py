"""Fixtures for the end-to-end suites: one server subprocess per module (and mode), real SDK clients.

Modes. Every module runs against `carpool serve` (embedded). Modules named in
`CARPOOL_E2E_CLUSTER_MODULES` (default: smoke, SDK training, security, bad input, checkpoints,
sampling and multi-tenant; `all` for every module) run a second time against `carpool cluster up`
when `CARPOOL_E2E_MODES` (default `embedded,cluster`) includes `cluster`; their test ids end in
`[embedded]` / `[cluster]`.
`CARPOOL_E2E_MODES=embedded` turns cluster runs off, `CARPOOL_E2E_MODES=cluster
CARPOOL_E2E_CLUSTER_MODULES=all` runs the whole suite in cluster mode only. Tests marked `slow` stay
embedded. A module with its own `server` fixture takes part in a two-mode run only if that fixture
requests `e2e_mode` (so each mode gets its own server); in a one-mode run it simply follows the mode.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server import MODES, TINY_MODEL_NAME, Server, set_default_mode, start_server

MODES_ENV = "CARPOOL_E2E_MODES"
CLUSTER_MODULES_ENV = "CARPOOL_E2E_CLUSTER_MODULES"
DEFAULT_MODES = "embedded,cluster"
DEFAULT_CLUSTER_MODULES = ("test_smoke,test_sdk_training,test_security,test_bad_input,test_sdk_checkpoints,"
                           "test_sdk_sampling,test_multi_tenant")


def _requested_modes() -> list[str]:
    modes = [m.strip() for m in os.environ.get(MODES_ENV, DEFAULT_MODES).split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise pytest.UsageError(f"{MODES_ENV}: unknown modes {unknown}; choose from {MODES}")
    return modes


def _modes_of(metafunc: pytest.Metafunc) -> list[str]:
    """The modes one test runs in (see the module docstring)."""
    modes = _requested_modes()
    modules = {m.strip() for m in os.environ.get(CLUSTER_MODULES_ENV, DEFAULT_CLUSTER_MODULES).split(",")}
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    clustered = ("all" in modules or module in modules) and metafunc.definition.get_closest_marker("slow") is None
    if not clustered or (len(modes) > 1 and not _server_follows_mode(metafunc)):
        return [m for m in modes if m == "embedded"]
    return modes


def _server_follows_mode(metafunc: pytest.Metafunc) -> bool:
    """Whether the `server` fixture this test uses is cached per mode (it requests `e2e_mode`)."""
    definitions = getattr(metafunc, "_arg2fixturedefs", {}).get("server")
    return bool(definitions) and "e2e_mode" in definitions[-1].argnames


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "e2e_mode" not in metafunc.fixturenames:
        return
    modes = _modes_of(metafunc)
    if modes != ["embedded"]:  # plain embedded runs keep their test ids
        metafunc.parametrize("e2e_mode", modes, indirect=True, scope="module")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """E2e tests run in file order within their module and mode (pytest-randomly shuffles the rest).

    A module shares one server (a model that trains on, checkpoints that pile up); its tests are scenarios
    read top to bottom, and a shuffle of them would test the shuffle. Runs after pytest's own grouping of
    module-scoped parameters, so each (module, mode) keeps its one server start.
    """
    first_seen: dict[tuple[str, str], int] = {}
    for index, item in enumerate(items):
        if _is_e2e(item):
            first_seen.setdefault(_module_and_mode(item), index)
    positions = [i for i, item in enumerate(items) if _is_e2e(item)]
    ordered = sorted((items[i] for i in positions),
                     key=lambda item: (first_seen[_module_and_mode(item)], item.reportinfo()[1] or 0, item.nodeid))
    for position, item in zip(positions, ordered, strict=True):
        items[position] = item


def _is_e2e(item: pytest.Item) -> bool:
    return Path(str(item.path)).parent == Path(__file__).parent


def _module_and_mode(item: pytest.Item) -> tuple[str, str]:
    callspec = getattr(item, "callspec", None)
    mode = callspec.params.get("e2e_mode", "embedded") if callspec is not None else "embedded"
    return str(item.path), str(mode)


@pytest.fixture(scope="module", autouse=True)
def e2e_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """The mode this module's servers start in (autouse: module-local `server` fixtures follow it too)."""
    mode = getattr(request, "param", "embedded")
    if mode == "cluster":
        from tests.e2e.cluster_mode import require_cluster_services

        require_cluster_services()
    set_default_mode(mode)
    try:
        yield mode
    finally:
        set_default_mode("embedded")


@pytest.fixture(scope="session")
def e2e_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen3 (hidden 64, vocab 512) with a local tokenizer and chat template."""
    from worker.models.devmodel import build_dev_model

    return build_dev_model(tmp_path_factory.mktemp("e2e-model"), layers=2, hidden=64, vocab=512, seed=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, e2e_model_dir: Path, e2e_mode: str) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp(f"carpool-data-{e2e_mode}"), e2e_model_dir, mode=e2e_mode)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def base_model() -> str:
    return TINY_MODEL_NAME
