"""The admin dashboard in a real browser (Playwright driving Debian's Chromium) against a real `carpool serve`.

Scenarios: log in; create a tenant and its key in the dashboard; train with the tinker SDK under that key
and see the run and its loss curve appear; download the usage CSV and find `GET /v1/usage`'s numbers in
it; revoke the key and see the SDK get 401; disable a tenant; a non-admin key refused; a cross-site form
post refused. Every page is screenshotted to `tests/browser/artifacts/` and checked with axe-core: no
serious or critical accessibility violations.
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from tests.e2e.server import TINY_MODEL_NAME, Server

pytestmark = pytest.mark.browser
AUTH_DEADLINE_S = 60.0
"""Generous bound for a revoked key to stop working (the gateway caches a valid key for 5 s by default)."""
TOKENS = [3, 7, 11, 15, 19, 23, 27]


@pytest.fixture(scope="module")
def admin_page(browser: Any, server: Server) -> Iterator[Any]:
    context = browser.new_context(accept_downloads=True)
    page = context.new_page()
    log_in(page, server, server.admin_key)
    assert page.url.endswith("/admin/"), page.url
    try:
        yield page
    finally:
        context.close()


def log_in(page: Any, server: Server, key: str) -> Any:
    page.goto(f"{server.url}/admin/login")
    page.fill("#api_key", key)
    with page.expect_navigation():
        page.click("button[type=submit]")
    return page


def create_tenant(page: Any, server: Server, name: str) -> str:
    """Create `name` through the dashboard's form; returns the key the page shows once."""
    page.goto(f"{server.url}/admin/tenants")
    page.fill("#name", name)
    with page.expect_navigation():
        page.click("text=Create tenant and its first key")
    return str(page.inner_text("#new-key")).strip()


def open_tenant(page: Any, server: Server, name: str) -> None:
    page.goto(f"{server.url}/admin/tenants?q={name}")
    with page.expect_navigation():
        page.click(f"a:text-is('{name}')")


def wait_for_401(key: str, server: Server) -> int:
    deadline = time.monotonic() + AUTH_DEADLINE_S
    status = 0
    while time.monotonic() < deadline:
        status = httpx.get(f"{server.url}/v1/usage", headers={"X-API-Key": key}, timeout=10).status_code
        if status == 401:
            break
        time.sleep(0.5)
    return status


def train(server: Server, key: str, steps: int) -> None:
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    client = service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=4, seed=0).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
    for _ in range(steps):
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def test_train_under_a_dashboard_key_then_see_the_loss_curve_the_usage_and_the_revocation(
        admin_page: Any, server: Server, artifacts: Path) -> None:
    page = admin_page
    key = create_tenant(page, server, "browser-corp")
    assert key.startswith("tml-")
    train(server, key, steps=3)

    page.goto(f"{server.url}/admin/runs?tenant=browser-corp")
    with page.expect_navigation():
        page.click("table a[href^='/admin/runs/']")
    assert page.locator("svg.chart polyline").count() == 1
    assert "3 points" in page.inner_text("#loss-summary")
    assert "3 optimizer steps" in page.inner_text("main")

    page.goto(f"{server.url}/admin/usage?tenant=browser-corp")
    with page.expect_download() as download_info:
        page.click("#csv-link")
    rows = list(csv.DictReader(io.StringIO(Path(download_info.value.path()).read_text())))
    usage = httpx.get(f"{server.url}/v1/usage", headers={"X-API-Key": key}, timeout=10).json()["usage"]
    kinds = {row["kind"] for row in rows}
    assert "forward_backward" in kinds
    for kind in kinds:
        assert sum(int(r["tokens"]) for r in rows if r["kind"] == kind) == usage[f"{kind}_tokens"]
        assert sum(int(r["requests"]) for r in rows if r["kind"] == kind) == usage[f"{kind}_requests"]

    open_tenant(page, server, "browser-corp")
    with page.expect_navigation():
        page.click(f"button[aria-label='Revoke key {key[:12]}']")
    assert "revoked" in page.inner_text("table")
    assert wait_for_401(key, server) == 401
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key=key).create_lora_training_client(
            base_model=TINY_MODEL_NAME, rank=4)


def test_disable_a_tenant(admin_page: Any, server: Server) -> None:
    page = admin_page
    key = create_tenant(page, server, "disable-corp")
    assert httpx.get(f"{server.url}/v1/usage", headers={"X-API-Key": key}, timeout=10).status_code == 200
    open_tenant(page, server, "disable-corp")
    with page.expect_navigation():
        page.click("text=Disable tenant")
    assert page.locator("main >> text=disabled").count() >= 1
    assert wait_for_401(key, server) == 401
    page.goto(f"{server.url}/admin/audit?tenant=disable-corp")
    assert "tenant.disable" in page.inner_text("table")


def test_a_non_admin_key_is_refused(browser: Any, admin_page: Any, server: Server) -> None:
    key = create_tenant(admin_page, server, "plain-browser")
    context = browser.new_context()
    try:
        page = log_in(context.new_page(), server, key)
        assert "Forbidden" in page.inner_text("h1") and "plain-browser" not in page.content()
        page.goto(f"{server.url}/admin/tenants")
        assert page.url.endswith("/admin/login")
    finally:
        context.close()


def test_a_cross_site_form_post_is_refused(admin_page: Any, server: Server) -> None:
    page = admin_page
    evil = ("<!doctype html><html lang='en'><title>evil</title><body>"
            f"<form method='post' action='{server.url}/admin/tenants'>"
            "<input type='hidden' name='name' value='evil-corp'><input type='hidden' name='csrf' value='guess'>"
            "<button id='go' type='submit'>win a prize</button></form></body></html>")
    page.route("http://evil.test/", lambda route: route.fulfill(status=200, content_type="text/html", body=evil))
    page.goto("http://evil.test/")
    with page.expect_navigation():
        page.click("#go")
    refused = page.url.endswith("/admin/login") or "Forbidden" in page.inner_text("h1")
    assert refused, page.url
    page.goto(f"{server.url}/admin/tenants?q=evil")
    assert "evil-corp" not in page.inner_text("table")


def test_every_page_screenshotted_and_without_serious_accessibility_violations(
        browser: Any, admin_page: Any, server: Server, artifacts: Path) -> None:
    from axe_playwright_python.sync_playwright import Axe

    page = admin_page
    key = create_tenant(page, server, "a11y-corp")
    page.screenshot(path=str(artifacts / "key-created.png"), full_page=True)
    train(server, key, steps=2)
    open_tenant(page, server, "a11y-corp")
    tenant_url = page.url
    page.goto(f"{server.url}/admin/runs?tenant=a11y-corp")
    run_href = page.get_attribute("table a[href^='/admin/runs/']", "href")
    run_url = f"{server.url}{run_href}"
    pages = {"overview": "/admin/", "tenants": "/admin/tenants", "tenant": tenant_url, "runs": "/admin/runs",
             "run": run_url, "requests": "/admin/requests", "checkpoints": "/admin/checkpoints",
             "usage": "/admin/usage", "workers": "/admin/workers", "scheduler": "/admin/scheduler?tenant=a11y-corp",
             "audit": "/admin/audit", "bad-request": "/admin/requests?kind=nope"}
    axe = Axe()
    problems = {}
    for name, path in pages.items():
        page.goto(path if path.startswith("http") else f"{server.url}{path}")
        page.screenshot(path=str(artifacts / f"{name}.png"), full_page=True)
        problems[name] = serious(axe.run(page).response)
    anonymous = browser.new_context()
    try:
        login = anonymous.new_page()
        login.goto(f"{server.url}/admin/login")
        login.screenshot(path=str(artifacts / "login.png"), full_page=True)
        problems["login"] = serious(axe.run(login).response)
    finally:
        anonymous.close()
    assert not any(problems.values()), problems
    assert len(list(artifacts.glob("*.png"))) >= len(pages) + 2


def serious(response: dict[str, Any]) -> list[str]:
    return [f"{v['id']}: {v['help']} ({len(v['nodes'])} nodes)" for v in response["violations"]
            if v.get("impact") in ("serious", "critical")]


def test_the_overview_refreshes_itself_under_the_content_security_policy(admin_page: Any, server: Server) -> None:
    page = admin_page
    violations: list[str] = []
    page.on("console", lambda message: violations.append(message.text)
            if "Content Security Policy" in message.text else None)
    page.goto(f"{server.url}/admin/")
    with page.expect_response(lambda r: r.url.endswith("/admin/overview/live") and r.status == 200,
                              timeout=30_000):
        pass  # htmx (vendored, loaded under script-src 'self') polls every 5 s
    assert page.locator("table td", has_text=TINY_MODEL_NAME).count() == 1
    assert not violations, violations
