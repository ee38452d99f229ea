"""The suite's SDK janitor (tests/sdk_janitor.py): it closes the clients a test body made, and only those."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace
from typing import Any

import pytest
import tinker

from tests import sdk_janitor
from tests.sdk_janitor import SdkJanitor


def is_closed(client: tinker.ServiceClient) -> bool:
    try:
        with client:
            return False
    except RuntimeError as error:
        assert "closed" in str(error)
        return True


def make_and_drop() -> int:
    """A test's local client: only its session's background heartbeat would outlive the body."""
    return id(tinker.ServiceClient(base_url="http://127.0.0.1:9", api_key="tml-" + "d" * 43))


def test_the_janitor_closes_the_clients_made_in_a_test_body_and_leaves_a_fixtures_open(
        monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[int] = []
    close = tinker.ServiceClient.close

    def noting_close(client: tinker.ServiceClient, *args: Any, **kwargs: Any) -> Any:
        closed.append(id(client))
        return close(client, *args, **kwargs)

    monkeypatch.setattr(tinker.ServiceClient, "close", noting_close)
    janitor = SdkJanitor()
    janitor.install()
    try:
        fixtures = tinker.ServiceClient(base_url="http://127.0.0.1:9", api_key="tml-" + "a" * 43)
        body = janitor.pytest_runtest_call(item=None)  # type: ignore[arg-type] - the hook ignores its item
        next(body)
        made = [tinker.ServiceClient(base_url="http://127.0.0.1:9", api_key="tml-" + "b" * 43) for _ in range(2)]
        assert not any(is_closed(client) for client in made)
        with pytest.raises(StopIteration):
            body.send(None)
        assert all(is_closed(client) for client in made)
        assert not is_closed(fixtures)
        body = janitor.pytest_runtest_call(item=None)  # type: ignore[arg-type]
        next(body)
        dropped = make_and_drop()
        with pytest.raises(StopIteration):
            body.send(None)
        assert dropped in closed
        after = tinker.ServiceClient(base_url="http://127.0.0.1:9", api_key="tml-" + "c" * 43)
        assert not is_closed(after)
    finally:
        janitor.uninstall()


class Hanging:
    """A client whose server never answers its close (stopped before the janitor came)."""

    def close(self, status: str) -> concurrent.futures.Future[None]:
        assert status == "success"
        return concurrent.futures.Future()


class Broken:
    def close(self, status: str) -> None:
        raise RuntimeError("the client is in a state no close can handle")


def test_close_all_counts_the_closes_still_waiting_and_survives_broken_clients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdk_janitor, "CLOSE_WAIT_S", 0.05)
    done = concurrent.futures.Future[None]()
    done.set_result(None)
    finished = type("Finished", (), {"close": lambda self, status: done})()
    assert sdk_janitor.close_all([Hanging(), finished, Broken(), Hanging()]) == 2
    assert sdk_janitor.close_all([finished]) == 0


class Reporter:
    """What `pytest_terminal_summary` writes."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def section(self, title: str, **_: Any) -> None:
        self.lines.append(f"== {title}")

    def line(self, text: str) -> None:
        self.lines.append(text)


def test_clients_a_fixture_left_heartbeating_are_named_at_the_end_with_their_fixture() -> None:
    janitor = SdkJanitor()
    janitor.install()
    fixturedef = SimpleNamespace(argname="sdk_server_client", scope="module")
    request = SimpleNamespace(node=SimpleNamespace(nodeid="tests/e2e/test_x.py::test_y"))
    try:
        setup = janitor.pytest_fixture_setup(fixturedef=fixturedef, request=request)  # type: ignore[arg-type]
        next(setup)
        made = [tinker.ServiceClient(base_url="http://127.0.0.1:9", api_key="tml-" + c * 43) for c in "efh"]
        with pytest.raises(StopIteration):
            setup.send(None)
        stray = tinker.ServiceClient(base_url="http://127.0.0.1:9", api_key="tml-" + "g" * 43)  # not a fixture's
        # Only a client with an open session holder heartbeats (these never reached a server, so fake one).
        left, holder_closed, unused = made
        left._session_holder = stray._session_holder = SimpleNamespace(_closed=False)  # type: ignore[assignment]
        holder_closed._session_holder = SimpleNamespace(_closed=True)  # type: ignore[assignment]
        assert [sdk_janitor.heartbeating(c) for c in made] == [True, False, False]
        reporter = Reporter()
        janitor.pytest_terminal_summary(reporter)  # type: ignore[arg-type]
        assert reporter.lines[1:] == ["sdk_server_client (module) for tests/e2e/test_x.py::test_y"]
        left._session_holder._closed = True  # type: ignore[union-attr]
        reporter = Reporter()
        janitor.pytest_terminal_summary(reporter)  # type: ignore[arg-type]
        assert reporter.lines == []
    finally:
        for client in (*made, stray):
            client._session_holder = None  # type: ignore[assignment]
        sdk_janitor.close_all([*made, stray])
        janitor.uninstall()
