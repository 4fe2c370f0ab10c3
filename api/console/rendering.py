"""How console pages are answered: the Jinja2 templates beside this module, and the route class that turns the
service's errors into pages (the JSON routes answer them as OpenAI errors)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates

from api.console.sessions import CsrfRefused, SignInNeeded, Viewer
from api.errors import STATUS_BY_KIND
from jobs.errors import ServiceError

PACKAGE = Path(__file__).parent
templates = Jinja2Templates(directory=PACKAGE / "templates")


def _when(moment: int | float | datetime | None) -> str:
    """A moment as the pages show it: UTC, to the second."""
    if moment is None:
        return "—"
    if not isinstance(moment, datetime):
        moment = datetime.fromtimestamp(moment, timezone.utc)
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _iso(moment: int | float | datetime | None) -> str:
    if moment is None:
        return ""
    if not isinstance(moment, datetime):
        moment = datetime.fromtimestamp(moment, timezone.utc)
    return moment.isoformat()


def _share(part: int, whole: int) -> int:
    """Whole percent of `part` in `whole`, for progress bars."""
    return round(100 * part / whole) if whole else 0


def _sparkline(values: list[float], top: float, width: int, height: int) -> str:
    """SVG polyline points of `values` spread over `width`, 0..top scaled to `height` (y grows downwards)."""
    if not values:
        return ""
    step = width / max(len(values) - 1, 1)
    scale = height / top if top else 0.0
    return " ".join(f"{i * step:.1f},{height - min(value, top) * scale:.1f}" for i, value in enumerate(values))


templates.env.filters.update(when=_when, iso=_iso)
templates.env.globals.update(share=_share, sparkline=_sparkline)


def page(request: Request, template: str, viewer: Viewer | None, status_code: int = 200, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(
        request, template, {"viewer": viewer, **context}, status_code=status_code, headers=_PAGE_HEADERS
    )


def confirm_page(request: Request, viewer: Viewer, question: str, consequence: str, button: str, back: str) -> HTMLResponse:
    """The page that confirms a state-changing action: its form posts to this same path, with the CSRF token."""
    return page(
        request, "confirm.html", viewer, title=question, explanation=consequence, action=request.url.path,
        confirm_label=button, back=back,
    )


_PAGE_HEADERS = {
    # Pages hold a project's data: not kept by shared caches, nor by the browser's back/forward cache after sign-out.
    "Cache-Control": "no-store",
    # Scripts only from the console itself, and no page inside another site's frame (its buttons cancel and delete).
    # Inline styles stay allowed: progress bars set their widths with them.
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'; "
    "form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
}


class ConsoleRoute(APIRoute):
    """A console route: no session sends the browser to sign in (a fragment polled by the page answers 401, which
    its script follows); a refused CSRF token answers 403, and a `ServiceError` its status, both as a page."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def console_handler(request: Request) -> Response:
            try:
                return await handle(request)
            except SignInNeeded:
                if request.url.path.endswith("/live"):
                    return Response("sign in again", status_code=401, media_type="text/plain")
                target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                return RedirectResponse(f"/console/sign-in?next={quote(target, safe='')}", status_code=303)
            except CsrfRefused:
                return page(request, "error.html", None, 403, message="This form is out of date: reload the page.")
            except ServiceError as error:
                return page(request, "error.html", None, STATUS_BY_KIND[error.kind], message=error.message)

        return console_handler
