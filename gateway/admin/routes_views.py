"""The dashboard's read pages: overview, runs, requests, checkpoints, usage, workers, scheduler, audit — and
the checkpoints page's one action, retrying a failed hub push (a CSRF-checked, audited form post).

Each page reads one page of rows through `services.admin.queries` (never a whole table) in one
transaction off the event loop; filters come from the query string and bad values answer 400 naming the
field. The scheduler page's "why refused" reads the tenant's token bucket and last refusal from the
limiter's own store (`AdminConsole.quota_standing`), so it shows what the next request would meet. The
overview's live table is also served alone (`/admin/overview/live`) for htmx to poll; without JavaScript
the page still shows it and a refresh link.

Charts are server-rendered SVG (`line_chart` for loss curves, `bar_chart` for usage per day), no JavaScript:
built from numbers only (labels are escaped), with presentation attributes rather than inline styles (the
CSP forbids those) and a `<title>` so screen readers announce what they show.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from html import escape
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from sqlalchemy.orm import Session

from gateway.admin.console import (
    SECURITY_HEADERS,
    BadParam,
    admin_session,
    check_csrf,
    console_of,
    int_param,
    now,
    page,
    redirect,
    text_param,
)
from services.admin import queries
from services.admin.actions import Actor, record_hub_push_retry
from services.admin.sessions import AdminSession
from services.auth.tenants import Tenant
from services.control.api import NotFound
from services.db.audit import list_audit
from services.db.ids import TenantId
from services.db.models import REQUEST_STATUSES
from services.db.request_log import count_unfinished_requests
from services.db.runs import count_active_training_runs
from services.db.tenants import get_tenant, get_tenant_by_name
from services.hub.service import NotRetryable
from services.metrics.process import histogram_mean, histogram_quantile

router = APIRouter()
Admin = Annotated[AdminSession, Depends(admin_session)]
MAX_OFFSET = 10_000_000
REQUEST_KINDS = ("create", "load", "forward", "forward_backward", "optim_step", "save", "sample")


def _page(request: Request) -> queries.Page:
    return queries.Page(console_of(request).page_size,
                        int_param(request, "offset", default=0, low=0, high=MAX_OFFSET))


def _tenant_filter(db: Session, request: Request, name: str = "tenant") -> tuple[str | None, str]:
    """The tenant named in the query string (by name or id): (id, shown name); 400 if there is none."""
    value = text_param(request, name)
    if value is None:
        return None, ""
    row = get_tenant_by_name(db, value) or get_tenant(db, TenantId(value))
    if row is None:
        raise BadParam(name, f"no tenant named {value!r}")
    return row.id, row.name


# -- overview and workers ---------------------------------------------------------------------------
def _overview(request: Request) -> list[dict[str, Any]]:
    console = console_of(request)
    registry = console.metrics.registry
    replicas = console.metrics.replicas()
    rows = []
    for stats in console.runtime_stats():
        model = stats.base_model
        mine = [r for r in replicas if r.base_model == model]
        rows.append({
            "stats": stats,
            "replicas": len(mine),
            "resident": sum(r.resident_adapters for r in mine),
            "adapters_per_pass": histogram_mean(registry, "carpool_pass_adapters", base_model=model),
            "wait_p50": histogram_quantile(registry, "carpool_queue_wait_seconds", 0.5, base_model=model),
            "wait_p95": histogram_quantile(registry, "carpool_queue_wait_seconds", 0.95, base_model=model),
        })
    return rows


@router.get("/")
async def overview(request: Request, session: Admin) -> Response:
    return page(request, "overview.html", {"session": session, "models": _overview(request), "active": "overview"})


@router.get("/overview/live")
async def overview_live(request: Request, session: Admin) -> Response:
    return page(request, "_overview_table.html", {"models": _overview(request)})


@router.get("/workers")
async def workers(request: Request, session: Admin) -> Response:
    console = console_of(request)
    stats = {s.base_model: s for s in console.runtime_stats()}
    return page(request, "workers.html", {"session": session, "replicas": console.metrics.replicas(),
                                          "stats": stats, "active": "workers"})


# -- runs -------------------------------------------------------------------------------------------
@router.get("/runs")
async def runs(request: Request, session: Admin) -> Response:
    def work(db: Session) -> dict[str, Any]:
        tenant_id, tenant_name = _tenant_filter(db, request)
        return {"listing": queries.runs(db, _page(request), tenant_id=tenant_id), "tenant": tenant_name}

    context = await console_of(request).tx(work)
    return page(request, "runs.html", {"session": session, **context, "active": "runs"})


@router.get("/runs/{run_id:path}")
async def run_detail(request: Request, session: Admin, run_id: str) -> Response:
    detail = await console_of(request).tx(lambda db: queries.run_detail(db, run_id[:256]))
    if detail is None:
        return page(request, "error.html", {"session": session, "title": "Not found",
                                            "message": "No such training run."}, 404)
    chart = line_chart([(float(s), v) for s, v in detail.losses], title=f"Loss of {detail.run.id}")
    return page(request, "run.html", {"session": session, "detail": detail, "chart": chart, "active": "runs"})


# -- requests, checkpoints, audit -------------------------------------------------------------------
@router.get("/requests")
async def requests(request: Request, session: Admin) -> Response:
    kind, status = text_param(request, "kind"), text_param(request, "status")
    if kind is not None and kind not in REQUEST_KINDS:
        raise BadParam("kind", f"must be one of {', '.join(REQUEST_KINDS)}")
    if status is not None and status not in REQUEST_STATUSES:
        raise BadParam("status", f"must be one of {', '.join(REQUEST_STATUSES)}")
    model = text_param(request, "model", max_length=256)

    def work(db: Session) -> dict[str, Any]:
        tenant_id, tenant_name = _tenant_filter(db, request)
        where = queries.RequestFilter(tenant_id=tenant_id, model_id=model, kind=kind, status=status)
        return {"listing": queries.requests(db, _page(request), where), "tenant": tenant_name}

    context = await console_of(request).tx(work)
    return page(request, "requests.html", {"session": session, **context, "kind": kind or "",
                                           "status": status or "", "model": model or "", "kinds": REQUEST_KINDS,
                                           "statuses": REQUEST_STATUSES, "active": "requests"})


@router.get("/checkpoints")
async def checkpoints(request: Request, session: Admin) -> Response:
    push_offset = int_param(request, "push_offset", default=0, low=0, high=MAX_OFFSET)

    def work(db: Session) -> dict[str, Any]:
        tenant_id, tenant_name = _tenant_filter(db, request)
        pushes = queries.hub_pushes(db, queries.Page(console_of(request).page_size, push_offset),
                                    tenant_id=tenant_id)
        return {"listing": queries.checkpoints(db, _page(request), tenant_id=tenant_id), "pushes": pushes,
                "tenant": tenant_name}

    context = await console_of(request).tx(work)
    retried = int_param(request, "retried", default=0, low=0, high=2**62) or None
    return page(request, "checkpoints.html", {"session": session, **context, "retried": retried,
                                              "can_retry": console_of(request).hub_pushes is not None,
                                              "active": "checkpoints"})


@router.post("/checkpoints/pushes/{push_id}/retry")
async def retry_push(request: Request, session: Admin, push_id: int) -> Response:
    """Queue a failed push again (same push id, same runner or Celery task), audited as `hub_push.retry`."""
    check_csrf(request, session, dict(await request.form()))
    hub = console_of(request).hub_pushes
    actor = Actor(session.tenant_id, session.key_prefix)
    try:
        if hub is None:
            raise NotFound("hub pushes are not configured on this server")
        view = await hub.retry_any(push_id, lambda db, row: record_hub_push_retry(db, actor, row))
    except NotRetryable as exc:
        return page(request, "error.html", {"session": session, "title": "Not retried", "field": "status",
                                            "message": exc.message}, 409)
    except NotFound as exc:
        return page(request, "error.html", {"session": session, "title": "Not found", "message": exc.message}, 404)
    return redirect(f"/admin/checkpoints?retried={view.id}")


@router.get("/audit")
async def audit(request: Request, session: Admin) -> Response:
    before = int_param(request, "before", default=0, low=0, high=2**62) or None

    def work(db: Session) -> dict[str, Any]:
        tenant_id, tenant_name = _tenant_filter(db, request)
        entries = list_audit(db, tenant_id=tenant_id, limit=console_of(request).page_size + 1, before_id=before)
        size = console_of(request).page_size
        return {"entries": entries[:size], "more": len(entries) > size, "tenant": tenant_name}

    context = await console_of(request).tx(work)
    return page(request, "audit.html", {"session": session, **context, "active": "audit"})


# -- usage ------------------------------------------------------------------------------------------
def _usage(request: Request, db: Session, listing_page: queries.Page) -> dict[str, Any]:
    days = int_param(request, "days", default=30, low=1, high=366)
    tenant_id, tenant_name = _tenant_filter(db, request)
    listing = queries.usage_by_day(db, listing_page, since=queries.days_ago(now(), days - 1), tenant_id=tenant_id)
    return {"listing": listing, "tenant": tenant_name, "days": days,
            "stored": queries.stored_bytes(db, sorted({line.tenant_id for line in listing.rows}))}


@router.get("/usage")
async def usage(request: Request, session: Admin) -> Response:
    # A page of usage is a page of tenants: each brings up to two rows (kinds) per day of the range.
    tenants_page = queries.Page(max(1, console_of(request).page_size // 5),
                                int_param(request, "offset", default=0, low=0, high=MAX_OFFSET))
    context = await console_of(request).tx(lambda db: _usage(request, db, tenants_page))
    per_day: dict[str, float] = {}
    for line in context["listing"].rows:
        per_day[line.day.isoformat()] = per_day.get(line.day.isoformat(), 0) + line.tokens
    chart = bar_chart(sorted(per_day.items()), title="Tokens per day (this page's rows)")
    return page(request, "usage.html", {"session": session, **context, "chart": chart, "active": "usage"})


@router.get("/usage.csv")
async def usage_csv(request: Request, session: Admin) -> Response:
    """Every row of the filter (paged internally, streamed as one CSV): day, tenant, kind, tokens, requests."""
    def work(db: Session) -> str:
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["day", "tenant", "kind", "tokens", "requests"])
        offset = 0
        while True:  # a page of 1,000 tenants at a time
            chunk = _usage(request, db, queries.Page(1000, offset))["listing"]
            writer.writerows([line.day.isoformat(), line.tenant_name, line.kind, line.tokens, line.requests]
                             for line in chunk.rows)
            if not chunk.more:
                return out.getvalue()
            offset += 1000

    body = await console_of(request).tx(work)
    headers = {**SECURITY_HEADERS, "Content-Disposition": 'attachment; filename="carpool-usage.csv"'}
    return Response(body, media_type="text/csv; charset=utf-8", headers=headers)


# -- scheduler and packing --------------------------------------------------------------------------
@router.get("/scheduler")
async def scheduler(request: Request, session: Admin) -> Response:
    def work(db: Session) -> dict[str, Any]:
        tenant_id, tenant_name = _tenant_filter(db, request)
        standing = None
        if tenant_id is not None:
            row = get_tenant(db, TenantId(tenant_id))
            assert row is not None
            read = console_of(request).quota_standing
            standing = {"tenant": row, "unfinished": count_unfinished_requests(db, TenantId(tenant_id)),
                        "active_models": count_active_training_runs(db, TenantId(tenant_id)),
                        "quotas": read(Tenant.from_row(row)) if read is not None else None}
        return {"passes": queries.recent_passes(db, limit=30),
                "standings": queries.standings(db, since=now() - timedelta(hours=1)),
                "tenant": tenant_name, "standing": standing}

    context = await console_of(request).tx(work)
    return page(request, "scheduler.html", {"session": session, **context,
                                            "budget": console_of(request).pass_token_budget, "active": "scheduler"})


# -- charts -----------------------------------------------------------------------------------------
WIDTH, HEIGHT, PAD = 640, 220, 40


@dataclass(frozen=True)
class Chart:
    """Markup ready for `|safe` in a template, and a one-line text summary for those who cannot see it."""

    svg: str
    summary: str


def _scale(values: Sequence[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    return (low, high) if high > low else (low - 1.0, high + 1.0)


def line_chart(points: Sequence[tuple[float, float]], *, title: str) -> Chart | None:
    """A polyline of (x, y) points, or None when there is nothing to draw."""
    if not points:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    (x0, x1), (y0, y1) = _scale(xs), _scale(ys)

    def at(x: float, y: float) -> str:
        px = PAD + (x - x0) / (x1 - x0) * (WIDTH - 2 * PAD)
        py = HEIGHT - PAD - (y - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)
        return f"{px:.1f},{py:.1f}"

    line = " ".join(at(x, y) for x, y in points)
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
           f'class="chart"><title>{escape(title)}</title>'
           f'{_axes(f"{y1:.4g}", f"{y0:.4g}", f"{x0:.0f}", f"{x1:.0f}")}'
           f'<polyline points="{line}" fill="none" stroke="#1f5fbf" stroke-width="2"/></svg>')
    summary = f"{len(points)} points; first {ys[0]:.4g}, last {ys[-1]:.4g}, min {min(ys):.4g}, max {max(ys):.4g}"
    return Chart(svg, summary)


def bar_chart(bars: Sequence[tuple[str, float]], *, title: str) -> Chart | None:
    """Vertical bars with their labels under them, or None when there is nothing to draw."""
    if not bars:
        return None
    top = max(v for _, v in bars) or 1.0
    slot = (WIDTH - 2 * PAD) / len(bars)
    parts = []
    for i, (label, value) in enumerate(bars):
        h = value / top * (HEIGHT - 2 * PAD)
        x = PAD + i * slot + slot * 0.15
        parts.append(f'<rect x="{x:.1f}" y="{HEIGHT - PAD - h:.1f}" width="{slot * 0.7:.1f}" height="{h:.1f}" '
                     f'fill="#1f5fbf"><title>{escape(label)}: {value:.0f}</title></rect>')
        if len(bars) <= 16:
            parts.append(f'<text x="{x + slot * 0.35:.1f}" y="{HEIGHT - PAD + 14}" font-size="10" '
                         f'text-anchor="middle" fill="#222">{escape(label[5:] if len(label) == 10 else label)}</text>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" class="chart">'
           f'<title>{escape(title)}</title>{_axes(f"{top:.4g}", "0", "", "")}{"".join(parts)}</svg>')
    summary = "; ".join(f"{label}: {value:.0f}" for label, value in bars[:31])
    return Chart(svg, summary)


def _axes(y_top: str, y_bottom: str, x_left: str, x_right: str) -> str:
    base = HEIGHT - PAD
    return (f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{base}" stroke="#555"/>'
            f'<line x1="{PAD}" y1="{base}" x2="{WIDTH - PAD}" y2="{base}" stroke="#555"/>'
            f'<text x="{PAD - 4}" y="{PAD + 4}" font-size="10" text-anchor="end" fill="#222">{escape(y_top)}</text>'
            f'<text x="{PAD - 4}" y="{base}" font-size="10" text-anchor="end" fill="#222">{escape(y_bottom)}</text>'
            f'<text x="{PAD}" y="{base + 28}" font-size="10" fill="#222">{escape(x_left)}</text>'
            f'<text x="{WIDTH - PAD}" y="{base + 28}" font-size="10" text-anchor="end" fill="#222">'
            f'{escape(x_right)}</text>')
