"""The admin dashboard over HTTP against a real `carpool serve`: sessions, CSRF, validation, escaping, keys.

- Sessions: no, garbage or expired cookie → redirect to the login page; logout ends the session; a session
  ends when the key that opened it is revoked; a non-admin key gets 403 and no admin data.
- CSRF: a form post without the session's token, with a forged one, or from another origin → 403.
- Forms: a negative quota, a taken or empty name → 400 with the message next to the field, never a 500.
- Checkpoints are listed, and a tenant deleting one lands in the audit log.
- Escaping: a tenant name with `<script>` renders inert. Keys: shown once (no-store), then never in a page,
  the audit log or the server's log. Pages carry a `'self'` Content-Security-Policy.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import tinker

from deploy import admin as operator
from deploy.admin import open_admin_database
from deploy.settings import ServiceSettings
from services.admin.sessions import open_session
from services.db.ids import ApiKeyId, TenantId
from services.db.tenants import get_tenant_by_name, list_api_keys
from tests.e2e.admin_login import admin_client, form_token, login
from tests.e2e.server import TINY_MODEL_NAME, Server

PAGES = ("/admin/", "/admin/overview/live", "/admin/tenants", "/admin/runs", "/admin/requests",
         "/admin/checkpoints", "/admin/usage", "/admin/workers", "/admin/scheduler", "/admin/audit")


@pytest.fixture(scope="module")
def admin(server: Server) -> Iterator[httpx.Client]:
    client = admin_client(server.url, server.admin_key)
    try:
        yield client
    finally:
        client.close()


def csrf(client: httpx.Client) -> str:
    return client.headers["X-Test-Csrf"]


def create_tenant(admin: httpx.Client, name: str, **fields: str) -> httpx.Response:
    return admin.post("/admin/tenants", data={"csrf": csrf(admin), "name": name, **fields})


def tenant_id(server: Server, name: str) -> str:
    db = open_admin_database(ServiceSettings(data_dir=server.data_dir))
    try:
        with db.sessions.begin() as session:
            row = get_tenant_by_name(session, name)
            assert row is not None
            return row.id
    finally:
        db.dispose()


def test_every_page_answers_with_a_strict_content_security_policy(admin: httpx.Client) -> None:
    for path in PAGES:
        answer = admin.get(path)
        assert answer.status_code == 200, (path, answer.text[:500])
        assert "default-src 'self'" in answer.headers["content-security-policy"]
        assert answer.headers["cache-control"] == "no-store" and answer.headers["x-frame-options"] == "DENY"
        assert "<script>" not in answer.text  # only the vendored htmx, by src


def test_without_a_valid_session_every_page_redirects_to_the_login(server: Server) -> None:
    with httpx.Client(base_url=server.url, follow_redirects=False, timeout=30) as anonymous:
        for path in PAGES:
            assert anonymous.get(path).headers.get("location") == "/admin/login", path
        anonymous.cookies.set("carpool_admin", "forged-token", path="/admin")
        assert anonymous.get("/admin/tenants").status_code == 303
        assert anonymous.post("/admin/tenants", data={"name": "x"}).headers["location"] == "/admin/login"


def test_an_expired_session_redirects_to_the_login(server: Server) -> None:
    db = open_admin_database(ServiceSettings(data_dir=server.data_dir))
    try:
        with db.sessions.begin() as session:
            admin_row = get_tenant_by_name(session, "admin")
            assert admin_row is not None
            key = list_api_keys(session, TenantId(admin_row.id))[0]
            token = open_session(session, tenant_id=TenantId(admin_row.id), api_key_id=ApiKeyId(key.id),
                                 ttl=timedelta(minutes=5), now=datetime.now(UTC) - timedelta(hours=1))
    finally:
        db.dispose()
    with httpx.Client(base_url=server.url, follow_redirects=False, timeout=30) as client:
        client.cookies.set("carpool_admin", token, path="/admin")
        assert client.get("/admin/").headers.get("location") == "/admin/login"


def test_the_session_cookie_is_http_only_same_site_strict_and_secure_behind_https(server: Server) -> None:
    with httpx.Client(base_url=server.url, follow_redirects=False, timeout=30) as client:
        cookie = login(client, server.admin_key).headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/admin" in cookie
        assert "Secure" not in cookie  # plain http: a Secure cookie would never come back
        token = form_token(client.get("/admin/login").text)
        behind_https = client.post("/admin/login", data={"csrf": token, "api_key": server.admin_key},
                                   headers={"X-Forwarded-Proto": "https"})
    assert behind_https.status_code == 303 and "Secure" in behind_https.headers["set-cookie"]


def test_a_non_admin_key_is_refused_and_sees_no_admin_data(server: Server, admin: httpx.Client) -> None:
    assert create_tenant(admin, "secret-name-visible-to-admins").status_code == 200
    key = operator.create_tenant(ServiceSettings(data_dir=server.data_dir), "plain-user")[1].key
    with httpx.Client(base_url=server.url, follow_redirects=False, timeout=30) as client:
        refused = login(client, key)
        assert refused.status_code == 403 and "carpool_admin=" not in refused.headers.get("set-cookie", "")
        assert "secret-name-visible-to-admins" not in refused.text
        assert client.get("/admin/tenants").headers.get("location") == "/admin/login"
        wrong = login(client, "tml-" + "x" * 43)
        assert wrong.status_code == 401 and 'id="api_key-error"' in wrong.text
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(r'carpool_auth_failures_total\{reason="forbidden"\} [1-9]', metrics), metrics[:1000]


def test_posts_without_the_sessions_csrf_token_are_refused(server: Server, admin: httpx.Client) -> None:
    before = admin.get("/admin/tenants?q=csrf").text
    assert admin.post("/admin/tenants", data={"name": "csrf-missing"}).status_code == 403
    assert admin.post("/admin/tenants", data={"name": "csrf-forged", "csrf": "forged"}).status_code == 403
    cross_site = admin.post("/admin/tenants", data={"name": "csrf-origin", "csrf": csrf(admin)},
                            headers={"Origin": "https://evil.example"})
    assert cross_site.status_code == 403
    assert admin.get("/admin/tenants?q=csrf").text.count("csrf-") == before.count("csrf-") == 0


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"name": ""}, "name", "is required"),
    ({"name": "admin"}, "name", "already exists"),
    ({"name": "ok-name", "tokens_per_minute": "-5"}, "tokens_per_minute", "must not be negative"),
    ({"name": "ok-name", "max_models": "many"}, "max_models", "must be a whole number"),
    ({"name": "<b>bad</b>"}, "name", "letters, digits"),
])
def test_bad_form_fields_are_400_with_the_error_next_to_the_field(
        admin: httpx.Client, fields: dict[str, str], field: str, message: str) -> None:
    answer = admin.post("/admin/tenants", data={"csrf": csrf(admin), **fields})
    assert answer.status_code == 400, answer.text[:500]
    error = re.search(rf'<input id="{field}"[^>]*aria-describedby="{field}-error"[^>]*>\s*'
                      rf'<span class="error" id="{field}-error">([^<]*)</span>', answer.text)
    assert error and message in error.group(1), answer.text[-3000:]


def test_quota_changes_are_validated_audited_and_bad_filters_are_400(server: Server, admin: httpx.Client) -> None:
    assert create_tenant(admin, "quota-corp").status_code == 200
    tid = tenant_id(server, "quota-corp")
    bad = admin.post(f"/admin/tenants/{tid}/quotas", data={"csrf": csrf(admin), "tokens_per_minute": "-1"})
    assert bad.status_code == 400 and 'id="tokens_per_minute-error"' in bad.text
    good = admin.post(f"/admin/tenants/{tid}/quotas", data={"csrf": csrf(admin), "tokens_per_minute": "900"})
    assert good.status_code == 303
    audit = admin.get("/admin/audit?tenant=quota-corp").text
    assert "quota.change" in audit and "900" in audit and "tenant.create" in audit
    for path, field in (("/admin/requests?kind=nope", "kind"), ("/admin/runs?offset=-1", "offset"),
                        ("/admin/usage?days=abc", "days"), ("/admin/runs?tenant=nobody-here", "tenant")):
        answer = admin.get(path)
        assert answer.status_code == 400 and f'data-field="{field}"' in answer.text, path
    assert admin.get("/admin/tenants/tenant-unknown").status_code == 404


def test_tenant_controlled_strings_render_inert(server: Server, admin: httpx.Client) -> None:
    operator.create_tenant(ServiceSettings(data_dir=server.data_dir), "<script>alert(1)</script>")
    page = admin.get("/admin/tenants?q=%3Cscript").text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script>alert(1)" not in page


def test_a_new_key_is_shown_once_and_never_again(server: Server, admin: httpx.Client) -> None:
    created = create_tenant(admin, "key-corp")
    key = re.search(r'id="new-key">(tml-[^<]+)<', created.text)
    assert key and created.headers["cache-control"] == "no-store"
    tid = tenant_id(server, "key-corp")
    second = admin.post(f"/admin/tenants/{tid}/keys", data={"csrf": csrf(admin), "label": "ci"})
    key2 = re.search(r'id="new-key">(tml-[^<]+)<', second.text)
    assert key2
    for path in (f"/admin/tenants/{tid}", "/admin/audit", "/admin/tenants"):
        text = admin.get(path).text
        assert key.group(1) not in text and key2.group(1) not in text and key2.group(1)[:12] in admin.get(
            f"/admin/tenants/{tid}").text
    assert key.group(1) not in server.log() and key2.group(1) not in server.log()


def test_revoking_the_key_of_a_session_ends_it_and_logout_ends_it_too(server: Server) -> None:
    settings = ServiceSettings(data_dir=server.data_dir)  # the CLI's code, without a process per command
    key = operator.create_tenant(settings, "second-admin", is_admin=True)[1].key
    client = admin_client(server.url, key)
    try:
        assert client.get("/admin/tenants").status_code == 200
        operator.revoke_keys(settings, key[:12])
        assert client.get("/admin/tenants").headers.get("location") == "/admin/login"
    finally:
        client.close()
    other = admin_client(server.url, server.admin_key)
    try:
        session_token = other.cookies.get("carpool_admin")
        token = form_token(other.get("/admin/tenants").text)
        assert other.post("/admin/logout", data={"csrf": token}).headers["location"] == "/admin/login"
        other.cookies.clear()
        other.cookies.set("carpool_admin", str(session_token), path="/admin")  # the old cookie, replayed
        assert other.get("/admin/").headers.get("location") == "/admin/login"
    finally:
        other.close()


def test_checkpoints_are_listed_and_their_deletion_audited(server: Server, admin: httpx.Client) -> None:
    key = operator.create_tenant(ServiceSettings(data_dir=server.data_dir), "ckpt-corp")[1].key
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    model = service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=4).result()
    path = model.save_state("nightly").result().path
    listed = admin.get("/admin/checkpoints?tenant=ckpt-corp").text
    assert path in listed and "ckpt-corp" in listed
    tinker.RestClient(base_url=server.url, api_key=key).delete_checkpoint_from_tinker_path(path).result()
    audit = admin.get("/admin/audit?tenant=ckpt-corp").text
    assert "checkpoint.delete" in audit and "weights/nightly" in audit
    assert path not in admin.get("/admin/checkpoints?tenant=ckpt-corp").text
    # The same process's /metrics carries the scheduler's series of that work (embedded mode: one registry).
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(r'carpool_queue_wait_seconds_count\{base_model="[^"]+",kind="create"\} [1-9]', metrics)
    assert re.search(r'carpool_barriers_total\{base_model="[^"]+",kind="save"\} [1-9]', metrics)
    assert re.search(r'carpool_scheduler_lease_held\{base_model="[^"]+"\} 1.0', metrics)
    assert re.search(r'carpool_adapters_known\{base_model="[^"]+",replica="embedded"\} [1-9]', metrics)
    assert "carpool_tenant_" not in metrics  # per-tenant series are opt-in


def test_a_key_revoked_or_a_tenant_disabled_in_the_dashboard_stops_working_at_once(
        server: Server, admin: httpx.Client) -> None:
    """Not after the gateways' auth caches expire (5 s): the dashboard announces the change as the CLI does,
    and only what changed: the tenant's other key keeps working until the tenant is disabled."""
    settings = ServiceSettings(data_dir=server.data_dir)
    tenant, first = operator.create_tenant(settings, "revoked-at-once")
    second = operator.create_key(settings, "revoked-at-once")[1]

    def status(key: str) -> int:
        return httpx.get(f"{server.url}/v1/usage", headers={"X-API-Key": key}, timeout=30).status_code

    assert status(first.key) == status(second.key) == 200  # both cached as good now
    revoked = admin.post(f"/admin/tenants/{tenant.id}/keys/{first.key_id}/revoke", data={"csrf": csrf(admin)})
    assert revoked.status_code == 303
    assert status(first.key) == 401 and status(second.key) == 200

    disabled = admin.post(f"/admin/tenants/{tenant.id}/status", data={"csrf": csrf(admin), "action": "disable"})
    assert disabled.status_code == 303
    assert status(second.key) == 401

