"""Admin dashboard benchmark: server time of each dashboard page and of a `/metrics` scrape at scale.

Creates a scratch PostgreSQL database (dropped afterwards), migrates it, and fills it with SQL
(`generate_series`) to 1,000 tenants, 10,000 training runs, 200,000 request-log rows (a mix of kinds,
failures with error texts, packed passes with losses), a week of hourly usage buckets per tenant, 1,000
checkpoints and 5,000 audit entries. Then it builds the real gateway app (`create_app` with the dashboard
over that database and an embedded-style metrics registry fed as after a busy day), logs in with an admin
key like a browser, and requests every dashboard page `--rounds` times in-process (Starlette's TestClient:
no network, so the time is the server's plus a few tens of microseconds).

Prints p50/p95 per page, then one machine-readable line (aims: <= 200 ms and <= 100 ms):
RESULT admin_page_p95_ms=X metrics_scrape_ms=X

    .venv/bin/python bench/admin.py [--rounds 20] [--tenants 1000] [--runs 10000] [--requests 200000]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import text

from services.auth.tenants import create_tenant_with_key
from services.control.plane import ServiceControlPlane
from services.control.registry import ServedModel
from services.db import open_database
from services.db.testing import scratch_postgres_database
from services.jobqueue import InMemoryNotifier, InMemoryResultStore, InMemoryWorkQueue
from services.metrics import ProcessMetrics, ReplicaSample
from services.scheduler.requests import RequestKind
from services.storage import LocalCheckpointStore, UrlSigner

FILL = """
INSERT INTO tenants (id, name, is_admin, disabled, created_at, tokens_per_minute)
  SELECT 'tenant-b' || lpad(i::text, 5, '0'), 'bench-' || lpad(i::text, 5, '0'), false, i % 97 = 0,
         now() - (i || ' minutes')::interval, CASE WHEN i % 3 = 0 THEN 100000 END
  FROM generate_series(0, :tenants - 1) i;
INSERT INTO api_keys (tenant_id, prefix, key_hash, label, created_at, last_used_at)
  SELECT 'tenant-b' || lpad((i % :tenants)::text, 5, '0'), 'tml-' || substr(md5(i::text), 1, 8),
         md5('key' || i) || md5('hash' || i), 'bench', now(), now()
  FROM generate_series(0, 2 * :tenants - 1) i;
INSERT INTO sessions (id, tenant_id, created_at, last_heartbeat_at, tags, user_metadata)
  SELECT 'sess-b' || i, 'tenant-b' || lpad(i::text, 5, '0'), now(), now(), '[]', '{}'
  FROM generate_series(0, :tenants - 1) i;
INSERT INTO training_runs (id, tenant_id, session_id, base_model, lora_rank, lora_config, user_metadata,
                           created_at, last_request_at, next_seq_id, status)
  SELECT 'sess-b' || (i % :tenants) || ':train:' || i, 'tenant-b' || lpad((i % :tenants)::text, 5, '0'),
         'sess-b' || (i % :tenants), 'bench/model', 8, '{}', '{"note": "<b>run</b>"}',
         now() - (i || ' seconds')::interval, now() - ((i / 2) || ' seconds')::interval, 21, 'active'
  FROM generate_series(0, :runs - 1) i;
INSERT INTO requests (id, tenant_id, model_id, kind, seq_id, status, error, category, created_at, started_at,
                      finished_at, num_tokens, pass_id, loss)
  SELECT 'req-b' || i, 'tenant-b' || lpad(((i % :runs) % :tenants)::text, 5, '0'),
         'sess-b' || ((i % :runs) % :tenants) || ':train:' || (i % :runs),
         CASE WHEN (i / :runs) % 2 = 0 THEN 'forward_backward' ELSE 'optim_step' END, i / :runs + 1,
         CASE WHEN i % 50 = 0 THEN 'failed' ELSE 'done' END,
         CASE WHEN i % 50 = 0 THEN 'loss_fn_inputs.weights: length 3 != 4 <script>x</script>' END,
         CASE WHEN i % 50 = 0 THEN 'user' END,
         now() - ((:requests - i) || ' seconds')::interval, now() - ((:requests - i) || ' seconds')::interval,
         now() - ((:requests - i) || ' seconds')::interval + interval '80 milliseconds', 512,
         'pass-b-' || (i / 8), CASE WHEN (i / :runs) % 2 = 0 THEN 40.0 / (1 + i / :runs) END
  FROM generate_series(0, :requests - 1) i;
INSERT INTO usage (tenant_id, bucket_start, kind, tokens, requests)
  SELECT 'tenant-b' || lpad(t::text, 5, '0'), date_trunc('hour', now()) - (h || ' hours')::interval, k,
         1000 + t + h, 10
  FROM generate_series(0, :tenants - 1) t, generate_series(0, 24 * 7 - 1) h,
       unnest(ARRAY['forward_backward', 'sample']) k;
INSERT INTO checkpoints (tenant_id, training_run_id, checkpoint_id, kind, tinker_path, storage_uri, size_bytes,
                         public, expires_at, user_metadata, created_at)
  SELECT 'tenant-b' || lpad((i % :tenants)::text, 5, '0'), 'sess-b' || (i % :tenants) || ':train:' || i,
         'weights/ckpt-' || i, 'training', 'tinker://run-' || i || '/weights/ckpt-' || i, 'file:///x/' || i,
         1048576 * (1 + i % 64), false, now() + interval '7 days', '{}', now() - (i || ' seconds')::interval
  FROM generate_series(0, :runs / 10 - 1) i;
INSERT INTO audit_log (created_at, actor_tenant_id, actor_key_prefix, action, target_type, target_id, tenant_id,
                       detail)
  SELECT now() - (i || ' seconds')::interval, NULL, NULL, 'quota.change', 'tenant',
         'tenant-b' || lpad((i % :tenants)::text, 5, '0'), 'tenant-b' || lpad((i % :tenants)::text, 5, '0'),
         '{"after": {"tokens_per_minute": 1000}}'
  FROM generate_series(0, 4999) i;
ANALYZE;
"""


def fill(url: str, tenants: int, runs: int, requests: int) -> float:
    db = open_database(url, migrate=True)
    started = time.perf_counter()
    try:
        with db.engine.begin() as connection:
            for statement in [s.strip() for s in FILL.split(";") if s.strip()]:
                connection.execute(text(statement), {"tenants": tenants, "runs": runs, "requests": requests})
    finally:
        db.dispose()
    return time.perf_counter() - started


def busy_metrics() -> ProcessMetrics:
    """An embedded process's registry after a busy day (so the overview and the scrape have numbers)."""
    metrics = ProcessMetrics.create(per_tenant=True)
    series = metrics.runtime.for_model("bench/model")
    for i in range(20_000):
        series.packed_pass(tokens=4096, adapters=1 + i % 16, tenants=1 + i % 8, seconds=0.05 + (i % 10) / 100)
        series.started([(RequestKind.FORWARD_BACKWARD.value, 1.0)], now=1.0 + (i % 50) / 10)
        series.finished(f"tenant-b{i % 200:05d}", "forward_backward", None, 512)
    metrics.add_replicas(lambda: [ReplicaSample("bench/model", f"r{i}", 32, 64, 10, 5, 2**30) for i in range(4)])
    return metrics


def build_app(url: str, scratch: Path) -> tuple[TestClient, str]:
    # Imported here, after `main` took bench/ off the path: bench/gateway.py would shadow the package.
    from gateway.app import create_app
    from gateway.auth import DatabaseAuthenticator
    from gateway.settings import GatewaySettings

    db = open_database(url)
    with db.sessions.begin() as session:
        admin_key = create_tenant_with_key(session, "bench-admin", is_admin=True)[1].key
    store = LocalCheckpointStore(scratch / "checkpoints", UrlSigner(b"0" * 32))
    control = ServiceControlPlane(db, InMemoryWorkQueue(), InMemoryResultStore(), InMemoryNotifier(), store,
                                  list[ServedModel]())
    settings = GatewaySettings()
    app = create_app(settings, control, DatabaseAuthenticator(db), metrics=busy_metrics(), admin_database=db,
                     pass_token_budget=32768)
    return TestClient(app, follow_redirects=False), admin_key


def log_in(client: TestClient, key: str) -> None:
    token = re.search(r'name="csrf" value="([^"]+)"', client.get("/admin/login").text)
    assert token
    answer = client.post("/admin/login", data={"csrf": token.group(1), "api_key": key})
    assert answer.status_code == 303, answer.text[:500]


def pages() -> list[str]:
    return ["/admin/", "/admin/overview/live", "/admin/tenants", "/admin/tenants?offset=950",
            "/admin/tenants/tenant-b00042", "/admin/runs", "/admin/runs?tenant=bench-00042",
            "/admin/runs/sess-b42:train:42", "/admin/requests", "/admin/requests?tenant=bench-00042",
            "/admin/requests?status=failed", "/admin/requests?kind=optim_step&offset=5000",
            "/admin/checkpoints", "/admin/usage", "/admin/usage?tenant=bench-00042", "/admin/workers",
            "/admin/scheduler", "/admin/scheduler?tenant=bench-00042", "/admin/audit",
            "/admin/audit?tenant=bench-00042"]


def timed(client: TestClient, path: str, rounds: int) -> list[float]:
    client.get(path)  # warm-up: the first request of a statement shape also plans and caches it
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        answer = client.get(path)
        times.append((time.perf_counter() - started) * 1000)
        assert answer.status_code == 200, (path, answer.status_code, answer.text[:300])
    return times


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, int(round(0.95 * len(values))) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=200_000)
    args = parser.parse_args()
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    with scratch_postgres_database(prefix="carpool_bench_admin") as url, tempfile.TemporaryDirectory() as scratch:
        seconds = fill(url, args.tenants, args.runs, args.requests)
        print(f"filled {args.tenants} tenants, {args.runs} runs, {args.requests} requests in {seconds:.1f} s")
        client, key = build_app(url, Path(scratch))
        with client:
            log_in(client, key)
            worst = 0.0
            for path in pages():
                times = timed(client, path, args.rounds)
                worst = max(worst, p95(times))
                print(f"{path:<45} p50 {statistics.median(times):7.1f} ms  p95 {p95(times):7.1f} ms")
            scrape = timed(client, "/metrics", args.rounds)
            print(f"{'/metrics':<45} p50 {statistics.median(scrape):7.1f} ms  p95 {p95(scrape):7.1f} ms")
            client.app.state.admin.database.dispose()  # type: ignore[attr-defined]
    print(f"RESULT admin_page_p95_ms={worst:.1f} metrics_scrape_ms={statistics.median(scrape):.1f}")


if __name__ == "__main__":
    main()
