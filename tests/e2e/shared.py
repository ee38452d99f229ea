"""Servers shared by the e2e modules that only touch their own tenants, and the test order that lets them.

A server start costs 12–26 s embedded and 27–38 s in cluster mode on two cores (`pytest --durations`), and
most e2e modules only need *a* server on the tiny model: they create their own tenants and never look at
anyone else's. Those modules use the conftest's `server` (or `smollm2_server`) fixture, which takes its
server from `SHARED`, keyed by (model, mode): one start serves every such module of a mode, and the
server sees many tenants' work, as a real one does. Modules that need their own settings or a fresh
server keep their own `server` fixture and are untouched.

`SharedOrder.sort_key` (used by the conftest's collection hook) makes each key's modules adjacent (all
embedded modules, then all cluster ones; within a mode the own-server modules first, then the tiny-model
modules, the module that uses both servers, the SmolLM2 ones), and the conftest's teardown hook calls
`SharedServers.keep_only` with what the next module needs, so a shared server stops as soon as no module
after it uses it, and at most the servers a module needs run at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from tests.e2e.server import Server

TINY, SMOLLM2 = "tiny", "smollm2"
SHARED_FIXTURES = {"server": TINY, "smollm2_server": SMOLLM2}
"""Fixture name → the shared server it hands out (only when defined in tests/e2e/conftest.py)."""
_RANK = {frozenset(): 0, frozenset({TINY}): 1, frozenset({TINY, SMOLLM2}): 2, frozenset({SMOLLM2}): 3}

Key = tuple[str, str]
"""(model, mode) of a shared server."""
Group = tuple[str, str]
"""(module path, mode): the unit the order keeps together (its module-scoped fixtures live that long)."""


class SharedServers:
    """The live shared servers, started on first use and stopped when told."""

    def __init__(self) -> None:
        self._live: dict[Key, Server] = {}

    def get(self, key: Key, start: Callable[[], Server]) -> Server:
        """The live server of `key`, started now if there is none or if the last one exited (a crash fails
        the tests that saw it, not every module after them)."""
        if key in self._live and self._live[key].process.poll() is not None:
            self._stop(key)
        if key not in self._live:
            self._live[key] = start()
        return self._live[key]

    def keep_only(self, keys: Iterable[Key]) -> None:
        """Stop every live server whose key is not in `keys`."""
        wanted = set(keys)
        for key in [k for k in self._live if k not in wanted]:
            self._stop(key)

    def _stop(self, key: Key) -> None:
        with contextlib.suppress(Exception):  # a stop that fails must not fail the next test
            self._live.pop(key).stop()


SHARED = SharedServers()


def is_ordered(item: pytest.Item) -> bool:
    """Tests whose modules are scenarios read top to bottom on one server: the e2e and compat suites."""
    return Path(str(item.path)).parent.name in ("e2e", "compat")


def group_of(item: pytest.Item) -> Group:
    callspec = getattr(item, "callspec", None)
    mode = callspec.params.get("e2e_mode", "embedded") if callspec is not None else "embedded"
    return str(item.path), str(mode)


def shared_models(item: pytest.Item) -> set[str]:
    """The shared servers `item` uses: its `server`/`smollm2_server` fixtures when they are the conftest's."""
    used = set()
    for name, model in SHARED_FIXTURES.items():
        definitions = item._fixtureinfo.name2fixturedefs.get(name, ()) if hasattr(item, "_fixtureinfo") else ()
        # pytest imports the conftest as `e2e.conftest`; tests/compat re-exports it as `tests.e2e.conftest`.
        if definitions and getattr(definitions[-1].func, "__module__", "").endswith("e2e.conftest"):
            used.add(model)
    return used


class SharedOrder:
    """Which shared servers each (module, mode) group needs, from the collected items."""

    def __init__(self) -> None:
        self.keys: dict[Group, set[Key]] = {}

    def record(self, items: list[pytest.Item]) -> None:
        for item in items:
            group = group_of(item)
            self.keys.setdefault(group, set()).update((model, group[1]) for model in shared_models(item))

    def sort_key(self, group: Group) -> tuple[int, int]:
        models = frozenset(model for model, _ in self.keys.get(group, ()))
        return (0 if group[1] == "embedded" else 1, _RANK.get(models, len(_RANK)))

    def needed_after(self, item: pytest.Item, nextitem: pytest.Item | None) -> set[Key]:
        """The servers to keep once `item` is done: the next test's group's, and this group's too while the
        same module goes on in another mode. pytest finalizes a module's fixtures of the last mode (an SDK
        client whose close still talks to its server) only while it sets up the next test, after this hook;
        the server stops at the next teardown instead."""
        if nextitem is None:
            return set()
        keep = set(self.keys.get(group_of(nextitem), set()))
        if group_of(nextitem)[0] == group_of(item)[0]:
            keep |= self.keys.get(group_of(item), set())
        return keep


ORDER = SharedOrder()
