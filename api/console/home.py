"""The console's entry: the sign-in form (an API key for a session), sign-out, and the overview."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from api.console.batches import batch_rows
from api.console.rendering import ConsoleRoute, page
from api.console.sessions import COOKIE_NAME, SESSION_SECONDS, FormViewerDep, ViewerDep
from api.deps import ReadEngineDep, SettingsDep
from jobs.telemetry.worker_samples import worker_histories

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)

OVERVIEW_ROWS = 10


def _local(target: str | None) -> str:
    """Where to go after sign-in: a console path only, never another site."""
    return target if target and target.startswith("/console") and not target.startswith("//") else "/console"


@router.get("", response_class=HTMLResponse)
def overview(request: Request, reads: ReadEngineDep, settings: SettingsDep, viewer: ViewerDep) -> Response:
    rows = batch_rows(reads, viewer.project_id, None, None)
    workers = worker_histories(request.app.state.redis, settings.redis_prefix)
    return page(
        request,
        "overview.html",
        viewer,
        **{**rows, "batches": rows["batches"][:OVERVIEW_ROWS], "live": False, "workers": workers},
    )


@router.get("/sign-in", response_class=HTMLResponse)
def sign_in_form(request: Request, next: str | None = None) -> HTMLResponse:
    return page(request, "sign_in.html", None, next=_local(next), problem=None)


@router.post("/sign-in")
async def sign_in(
    request: Request, api_key: Annotated[str, Form()] = "", next: Annotated[str, Form()] = "/console"
) -> Response:
    secret = api_key.strip()
    project_id = await request.app.state.keys.project_for(secret) if secret else None
    if project_id is None:
        problem = "Enter an API key." if not secret else "That API key is not valid (or was revoked)."
        return page(request, "sign_in.html", None, 401, next=_local(next), problem=problem)
    token = await run_in_threadpool(request.app.state.console_sessions.open, secret)
    response = RedirectResponse(_local(next), status_code=303)
    response.set_cookie(
        COOKIE_NAME,
        token,
        max_age=SESSION_SECONDS,
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/sign-out")
async def sign_out(request: Request, viewer: FormViewerDep) -> Response:
    await run_in_threadpool(request.app.state.console_sessions.close, request.cookies[COOKIE_NAME])
    response = RedirectResponse("/console/sign-in", status_code=303)
    response.delete_cookie(COOKIE_NAME, path="/console", httponly=True, samesite="strict")
    return response
