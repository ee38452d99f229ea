"""The operators' web dashboard at `/admin`: server-rendered Jinja2 pages, enhanced (never required) by htmx.

`install_admin(app, console)` mounts the routes, the vendored static files (htmx, the stylesheet; no CDN,
no Node build) and the handlers that turn a missing session into a redirect to the login page, a bad CSRF
token into 403 and a bad query parameter into 400 naming it. See docs/operations.md.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles

from gateway.admin import routes_auth, routes_tenants, routes_views
from gateway.admin.console import (
    STATIC_DIR,
    AdminConsole,
    BadParam,
    CsrfRefused,
    NotLoggedIn,
    make_templates,
    page,
    redirect,
)

__all__ = ["AdminConsole", "install_admin", "make_templates"]


def install_admin(app: FastAPI, console: AdminConsole) -> None:
    app.state.admin = console
    for module in (routes_auth, routes_tenants, routes_views):
        app.include_router(module.router, prefix="/admin", include_in_schema=False)
    app.mount("/admin/static", StaticFiles(directory=STATIC_DIR), name="admin-static")
    app.add_exception_handler(NotLoggedIn, _to_login)
    app.add_exception_handler(CsrfRefused, _csrf_refused)
    app.add_exception_handler(BadParam, _bad_param)


async def _to_login(request: Request, exc: Exception) -> Response:
    if request.headers.get("hx-request"):  # an htmx poll: make the browser load the login page
        response = Response(status_code=401, headers={"HX-Redirect": "/admin/login"})
        return response
    return redirect("/admin/login")


async def _csrf_refused(request: Request, exc: Exception) -> Response:
    return page(request, "error.html", {"title": "Forbidden", "message": "This form was not sent from this "
                                        "dashboard (its CSRF token is missing or wrong). Reload the page."}, 403)


async def _bad_param(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadParam)
    return page(request, "error.html", {"title": "Bad request", "field": exc.field,
                                        "message": f"{exc.field}: {exc.message}"}, 400)
