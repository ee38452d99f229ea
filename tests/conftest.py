"""Shared fixtures: tiny random-weight Qwen3 models built locally (no hub), offline settings; the SDK clients a
test leaves open are closed after it (tests/sdk_janitor.py); processes the run leaves alive are listed in the
summary (tests/leftovers.py); and the end of a strict run (CI, `make test`): it
fails when any test other than the CUDA ones was skipped (tests/required.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.leftovers import LeftoverReport
from tests.required import ALLOWED_SKIP_MARKERS, STRICT_ENV, strict
from tests.s3_support import s3_bucket, s3_server  # noqa: F401 - session S3 server (moto) fixtures
from tests.sdk_janitor import SdkJanitor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# The SDK's telemetry thread retries its posts with jittered backoff after a client's test (and server) ended,
# drawing from the process-wide `random` under hypothesis's feet in later tests; one e2e test turns it on
# (tests/e2e/test_smoke.py::test_sdk_telemetry_reaches_the_server).
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen3 (hidden 64, vocab 512, GQA) with a locally trained tokenizer."""
    from worker.models.devmodel import build_dev_model

    return build_dev_model(tmp_path_factory.mktemp("tiny-qwen3"), layers=2, hidden=64, vocab=512, seed=0)


class SkipAudit:
    """Collects the skips a strict run does not accept (anything but the CUDA tests) and fails the run."""

    def __init__(self) -> None:
        self.skipped: list[tuple[str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        if any(marker in report.keywords for marker in ALLOWED_SKIP_MARKERS):
            return
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        self.skipped.append((report.nodeid, reason))

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.skipped and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.skipped:
            return
        terminalreporter.section("skips a strict run does not accept", red=True)
        for nodeid, reason in self.skipped:
            terminalreporter.line(f"SKIPPED {nodeid}: {reason}")
        terminalreporter.line(f"{len(self.skipped)} test(s) skipped besides the CUDA ones (marker gpu); with "
                              f"CI=true or {STRICT_ENV}=1 every service, program and browser the suite uses must "
                              "be there: the run fails.", red=True)


def pytest_configure(config: pytest.Config) -> None:
    if strict():
        config.pluginmanager.register(SkipAudit(), "carpool-skip-audit")
    janitor = SdkJanitor()
    janitor.install()
    config.pluginmanager.register(janitor, "carpool-sdk-janitor")
    config.pluginmanager.register(LeftoverReport(), "carpool-leftovers")


def pytest_unconfigure(config: pytest.Config) -> None:
    janitor = config.pluginmanager.get_plugin("carpool-sdk-janitor")
    if isinstance(janitor, SdkJanitor):
        janitor.uninstall()
