"""Console pages of files, schedules, webhook endpoints (with deliveries and attempts), models and workers. Reads and
deletes are the JSON routes' own, for the session's project."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, StreamingResponse

from api.console.rendering import ConsoleRoute, confirm_page, page
from api.console.sessions import FormViewerDep, ViewerDep
from api.deps import ReadEngineDep, ReadSessionsDep, SettingsDep, StoreDep, WriteSessionsDep
from api.files import file_content
from api.schemas import FileObject, ScheduleObject, WebhookDeliveryObject, WebhookEndpointObject
from jobs import files
from jobs.schedules import definitions as schedules
from jobs.schedules.cron import next_fire_time
from jobs.served_models import listed_names, parse_aliases
from jobs.telemetry.worker_samples import worker_histories
from jobs.webhooks import endpoints

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)

PAGE_ROWS = 50
NEXT_FIRES_SHOWN = 3  # a schedule's coming fire times on its row


@router.get("/files", response_class=HTMLResponse)
def file_list(request: Request, reads: ReadEngineDep, viewer: ViewerDep, after: str | None = None) -> HTMLResponse:
    with reads.connect() as connection:
        listed = files.list_files(connection, viewer.project_id, after=after, limit=PAGE_ROWS, order="desc", purpose=None)
    return page(
        request, "files.html", viewer, files=[FileObject.of(row) for row in listed.rows], has_more=listed.has_more
    )


@router.get("/files/{file_id}/content")
def file_download(file_id: str, sessions: ReadSessionsDep, store: StoreDep, viewer: ViewerDep) -> StreamingResponse:
    return file_content(sessions, store, viewer.project_id, file_id)


@router.get("/files/{file_id}/delete", response_class=HTMLResponse)
def confirm_file_delete(request: Request, file_id: str, sessions: ReadSessionsDep, viewer: ViewerDep) -> HTMLResponse:
    with sessions() as session:
        row = files.get_file(session, viewer.project_id, file_id)
    return confirm_page(
        request,
        viewer,
        f"Delete file {row.filename}?",
        f"{row.id} and its bytes are deleted; batches that name it keep their own records.",
        "Delete the file",
        "/console/files",
    )


@router.post("/files/{file_id}/delete")
def delete_file(file_id: str, sessions: WriteSessionsDep, store: StoreDep, viewer: FormViewerDep) -> RedirectResponse:
    with sessions() as session:
        files.delete_file(session, store, viewer.project_id, file_id)
    return RedirectResponse("/console/files", status_code=303)


def _next_fires(schedule: ScheduleObject, first: datetime) -> list[str]:
    """The schedule's next fire times on its own time zone's clock."""
    zone = ZoneInfo(schedule.timezone)
    fires = [first]
    while len(fires) < NEXT_FIRES_SHOWN:
        fires.append(next_fire_time(schedule.cron, schedule.timezone, fires[-1]))
    return [fire.astimezone(zone).strftime("%Y-%m-%d %H:%M %Z") for fire in fires]


@router.get("/schedules", response_class=HTMLResponse)
def schedule_list(
    request: Request, sessions: ReadSessionsDep, settings: SettingsDep, viewer: ViewerDep, after: str | None = None
) -> HTMLResponse:
    with sessions() as session:
        listed = schedules.list_schedules(session, viewer.project_id, after=after, limit=PAGE_ROWS)
    rows = [(ScheduleObject.of(row, settings.s3), row.next_fire_at) for row in listed.rows]
    shown = [(schedule, [] if schedule.paused else _next_fires(schedule, first)) for schedule, first in rows]
    return page(request, "schedules.html", viewer, schedules=shown, has_more=listed.has_more)


@router.get("/webhooks", response_class=HTMLResponse)
def webhook_list(request: Request, sessions: ReadSessionsDep, viewer: ViewerDep, after: str | None = None) -> HTMLResponse:
    with sessions() as session:
        listed = endpoints.list_endpoints(session, viewer.project_id, after=after, limit=PAGE_ROWS)
    hooks = [WebhookEndpointObject.of(row) for row in listed.rows]
    return page(request, "webhooks.html", viewer, endpoints=hooks, has_more=listed.has_more)


@router.get("/webhooks/{webhook_id}", response_class=HTMLResponse)
def webhook_page(
    request: Request, webhook_id: str, sessions: ReadSessionsDep, viewer: ViewerDep, after: str | None = None
) -> HTMLResponse:
    with sessions() as session:
        endpoint = WebhookEndpointObject.of(endpoints.get_endpoint(session, viewer.project_id, webhook_id))
        listed = endpoints.list_deliveries(session, viewer.project_id, webhook_id, after=after, limit=PAGE_ROWS)
    deliveries = [WebhookDeliveryObject.of(history) for history in listed.deliveries]
    return page(request, "webhook.html", viewer, endpoint=endpoint, deliveries=deliveries, has_more=listed.has_more)


@router.get("/webhooks/{webhook_id}/delete", response_class=HTMLResponse)
def confirm_webhook_delete(
    request: Request, webhook_id: str, sessions: ReadSessionsDep, viewer: ViewerDep
) -> HTMLResponse:
    with sessions() as session:
        endpoint = endpoints.get_endpoint(session, viewer.project_id, webhook_id)
    return confirm_page(
        request,
        viewer,
        f"Delete webhook endpoint {endpoint.name}?",
        "Events stop going to it; its deliveries and their attempts are deleted with it.",
        "Delete the endpoint",
        f"/console/webhooks/{endpoint.id}",
    )


@router.post("/webhooks/{webhook_id}/delete")
def delete_webhook(webhook_id: str, sessions: WriteSessionsDep, viewer: FormViewerDep) -> RedirectResponse:
    with sessions.begin() as session:
        endpoints.delete_endpoint(session, viewer.project_id, webhook_id)
    return RedirectResponse("/console/webhooks", status_code=303)


@router.get("/models", response_class=HTMLResponse)
def model_list(request: Request, settings: SettingsDep, viewer: ViewerDep) -> HTMLResponse:
    served = request.app.state.models.served()
    names = listed_names(served, parse_aliases(settings.model_aliases))
    workers = worker_histories(request.app.state.redis, settings.redis_prefix)
    models = [
        {
            "model": model,
            "names": sorted(name for name, named in names.items() if named.id == model.id),
            "workers": [worker.name for worker in workers if model.id in worker.models],
        }
        for model in served
    ]
    return page(request, "models.html", viewer, models=models)


def _workers(request: Request, settings: SettingsDep) -> dict:
    return {"workers": worker_histories(request.app.state.redis, settings.redis_prefix)}


@router.get("/workers", response_class=HTMLResponse)
def worker_list(request: Request, settings: SettingsDep, viewer: ViewerDep) -> HTMLResponse:
    return page(request, "workers.html", viewer, **_workers(request, settings))


@router.get("/workers/live", response_class=HTMLResponse)
def worker_list_live(request: Request, settings: SettingsDep, viewer: ViewerDep) -> HTMLResponse:
    return page(request, "workers_live.html", viewer, **_workers(request, settings))
