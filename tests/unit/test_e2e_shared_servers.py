"""The e2e suites' shared servers: which ones stay up after a test (tests/e2e/shared.py).

A module that runs in both modes holds its embedded module fixtures (an SDK client that closes its session
on the way out) until pytest sets up the module's first cluster test, which is after the teardown hook
that stops servers. Stopping the embedded server there left that close talking to nobody: a setup error of
the cluster test after two minutes of retries whenever such a module ran last among the embedded ones or
on its own.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests.e2e.shared import SharedOrder


def _item(path: str, mode: str) -> Any:
    return SimpleNamespace(path=path, callspec=SimpleNamespace(params={"e2e_mode": mode}))


def _order() -> SharedOrder:
    order = SharedOrder()
    order.keys = {("m.py", "embedded"): {("tiny", "embedded")}, ("m.py", "cluster"): {("tiny", "cluster")},
                  ("n.py", "cluster"): {("tiny", "cluster"), ("smollm2", "cluster")}}
    return order


def test_a_module_going_on_in_another_mode_keeps_its_last_modes_servers_one_test_longer() -> None:
    order = _order()
    assert order.needed_after(_item("m.py", "embedded"), _item("m.py", "cluster")) == {
        ("tiny", "embedded"), ("tiny", "cluster")}
    assert order.needed_after(_item("m.py", "cluster"), _item("m.py", "cluster")) == {("tiny", "cluster")}


def test_other_modules_keep_only_what_the_next_test_needs() -> None:
    order = _order()
    assert order.needed_after(_item("m.py", "cluster"), _item("n.py", "cluster")) == {
        ("tiny", "cluster"), ("smollm2", "cluster")}
    assert order.needed_after(_item("n.py", "cluster"), None) == set()
