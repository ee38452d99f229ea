"""Fixtures for the end-to-end suites: server subprocesses shared between modules, real SDK clients.

Servers. `server` (the tiny model) and `smollm2_server` are shared by every module that uses them, one per
mode (tests/e2e/shared.py): such modules create their own tenants and must not assume a fresh server.
A module that needs its own settings or a fresh server defines its own `server` fixture.

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

from tests.e2e.server import MODES, SMOLLM2_MODEL_NAME, TINY_MODEL_NAME, Server, set_default_mode, start_server
from tests.e2e.shared import ORDER, SHARED, SMOLLM2, TINY, Group, group_of, is_ordered

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
    """E2e and compat tests run as one block, in file order within their module and mode (pytest-randomly
    shuffles the rest and the order of the modules).

    A module's tests share a server (a model that trains on, checkpoints that pile up); they are scenarios
    read top to bottom, and a shuffle of them would test the shuffle. The block puts the modules that share a
    server (tests/e2e/shared.py) next to each other, so each shared server starts once per mode. Runs after
    pytest's own grouping of module-scoped parameters, so each (module, mode) keeps its one server start.
    """
    block = [item for item in items if is_ordered(item)]
    if not block:
        return
    ORDER.record(block)
    first_seen: dict[Group, int] = {}
    for index, item in enumerate(block):
        first_seen.setdefault(group_of(item), index)
    block.sort(key=lambda item: (ORDER.sort_key(group_of(item)), first_seen[group_of(item)],
                                 item.reportinfo()[1] or 0, item.nodeid))
    start = next(i for i, item in enumerate(items) if is_ordered(item))
    rest = [item for item in items if not is_ordered(item)]
    items[:] = rest[:start] + block + rest[start:]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop a shared server as soon as no test needs it (`SharedOrder.needed_after`)."""
    SHARED.keep_only(ORDER.needed_after(item, nextitem))


def pytest_sessionfinish() -> None:
    SHARED.keep_only(())


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
def server(tmp_path_factory: pytest.TempPathFactory, e2e_model_dir: Path, e2e_mode: str) -> Server:
    """The tiny model's server of this mode, shared by every module that uses this fixture (shared.py):
    such a module creates its own tenants and must not assume a fresh server."""
    return SHARED.get((TINY, e2e_mode), lambda: start_server(
        tmp_path_factory.mktemp(f"carpool-shared-{e2e_mode}"), e2e_model_dir, mode=e2e_mode))


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory, e2e_mode: str) -> Server:
    """A `carpool serve` of SmolLM2-135M-Instruct, shared like `server` (slow tests: embedded only)."""
    from worker.models.sources import default_cache_dir

    # The converted GGUF is cached outside the data dir, so only the first run ever converts it.
    env = {"CARPOOL_CACHE_DIR": os.environ.get("CARPOOL_CACHE_DIR", str(default_cache_dir()))}
    return SHARED.get((SMOLLM2, e2e_mode), lambda: start_server(
        tmp_path_factory.mktemp(f"carpool-smollm2-{e2e_mode}"), extra_env=env,
        base_model_spec=f"{SMOLLM2_MODEL_NAME}=smollm2-135m", timeout_s=600, mode=e2e_mode))


@pytest.fixture(scope="module")
def base_model() -> str:
    return TINY_MODEL_NAME
