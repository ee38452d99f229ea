"""Logging in to the admin dashboard over plain HTTP, as a browser's form post would (for the e2e tests)."""

from __future__ import annotations

import re

import httpx

CSRF_FIELD = re.compile(r'name="csrf" value="([^"]+)"')


def form_token(html: str) -> str:
    match = CSRF_FIELD.search(html)
    assert match, html[:2000]
    return match.group(1)


def login(client: httpx.Client, api_key: str) -> httpx.Response:
    """Open the login form (its token comes with a cookie), post the key; returns the answer (303 on success)."""
    token = form_token(client.get("/admin/login").text)
    return client.post("/admin/login", data={"csrf": token, "api_key": api_key})


def admin_client(base_url: str, api_key: str) -> httpx.Client:
    """A client holding a dashboard session of `api_key` (an admin key), its CSRF token in `.csrf`."""
    client = httpx.Client(base_url=base_url, follow_redirects=False, timeout=30)
    answer = login(client, api_key)
    assert answer.status_code == 303 and answer.headers["location"] == "/admin/", answer.text[:2000]
    client.headers["X-Test-Csrf"] = form_token(client.get("/admin/tenants").text)
    return client
