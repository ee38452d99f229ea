"""Closes the `tinker.ServiceClient`s a test made and left open, right after the test body, while its server is
still up.

Why: an open client heartbeats its session and flushes telemetry from a daemon thread for the rest of the run.
Once the test's server is gone, that thread fails every few seconds and formats the failure's traceback, and
CPython 3.11 parses source with `ast.parse` to place the carets under it. Before 3.11.8 the AST converter keeps
its recursion counter per interpreter, not per thread (cpython#106905), so a test parsing source at that moment
fails with "SystemError: AST constructor recursion depth mismatch". Closing the clients stops those threads,
and a real service's tenant would close its client too (context exit or `close()`)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

CLOSE_WAIT_S = 5.0
"""How long the finish calls of one test's clients may take together; a server the test already stopped
answers nothing, and the SDK would retry for minutes, so the janitor stops waiting (the run goes on)."""


class SdkJanitor:
    """A pytest plugin: records every ServiceClient made while a test body runs and closes the open ones
    after it. Clients a fixture makes are the fixture's to close; those still open at the end of the run are
    listed in the summary with the fixture that made them. It holds the clients themselves: a test's
    local client is collected when the body returns, but its session's heartbeat lives on in the SDK's
    background loop, and only the client can finish it."""

    def __init__(self) -> None:
        self._made: list[Any] = []
        self._recording = False
        self._fixture: str | None = None
        """`name (scope) for nodeid` of the fixture being set up, while one is."""
        self._fixture_made: list[tuple[Any, str]] = []
        """Clients fixtures made, with the fixture that made each: listed at the end if still open."""
        self._patches = pytest.MonkeyPatch()

    def install(self) -> None:
        """Wrap `ServiceClient.__init__` so each new client is noted while a test body runs."""
        import tinker

        original = tinker.ServiceClient.__init__
        janitor = self

        def noting_init(client: Any, *args: Any, **kwargs: Any) -> None:
            original(client, *args, **kwargs)
            if janitor._recording:
                janitor._made.append(client)
            elif janitor._fixture is not None:
                janitor._fixture_made.append((client, janitor._fixture))

        self._patches.setattr(tinker.ServiceClient, "__init__", noting_init)

    def uninstall(self) -> None:
        self._patches.undo()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any],
                             request: pytest.FixtureRequest) -> Iterator[None]:
        named = f"{fixturedef.argname} ({fixturedef.scope}) for {request.node.nodeid}"
        outer, self._fixture = self._fixture, named
        try:
            yield
        finally:
            self._fixture = outer

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        """Fixture-made clients still open at the end: their heartbeats outlive their servers (a CI run logged
        "Session heartbeat failed" from one); the fixture named is the one to fix."""
        still_open = [fixture for client, fixture in self._fixture_made if heartbeating(client)]
        if still_open:
            terminalreporter.section("tinker clients fixtures left open (informational)", yellow=True)
            for fixture in still_open:
                terminalreporter.line(fixture)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        self._made, self._recording = [], True
        try:
            yield
        finally:
            self._recording = False
            left = close_all(self._made)
            self._made = []
            if left:
                warnings.warn(f"{left} tinker client(s) of {item.nodeid} could not finish their session in "
                              f"{CLOSE_WAIT_S:.0f} s (the server was probably stopped first): close them before "
                              "the server, e.g. `with tinker.ServiceClient(...) as client:`", stacklevel=1)


def heartbeating(client: Any) -> bool:
    """Whether `client` still heartbeats a session: neither it nor its session's holder was closed (a client
    never used has no session and no heartbeat)."""
    holder = getattr(client, "_session_holder", None)
    return not getattr(client, "_closed", True) and holder is not None and not getattr(holder, "_closed", True)


def close_all(clients: list[Any]) -> int:
    """Finish each client's session (a no-op for one already closed) and wait, all together, up to
    CLOSE_WAIT_S; a close that fails is left to the SDK. Returns how many were still waiting then."""
    futures = []
    for client in clients:
        try:
            futures.append(client.close("success"))
        except Exception:  # noqa: BLE001 - a test may leave its client in any state; cleanup must not fail it
            continue
    deadline, waiting = time.monotonic() + CLOSE_WAIT_S, 0
    for future in futures:
        try:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            waiting += 1
        except Exception:  # noqa: BLE001 - see above
            continue
    return waiting
