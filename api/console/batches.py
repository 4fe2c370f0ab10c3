"""Console pages of batches and RAG jobs: the lists (live), a batch's page (live), cancel. Every read and write is the
one /v1/batches and /v1/rag/jobs make, for the session's project."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from api.batches import cancel_job
from api.console.rendering import ConsoleRoute, confirm_page, page
from api.console.sessions import FormViewerDep, ViewerDep
from api.deps import ReadEngineDep, ReadSessionsDep, StopFlagsDep, StoreDep, WriteSessionsDep
from api.schemas import BatchObject, RagJobObject
from jobs import batches
from jobs.batch_errors import first_errors
from jobs.models import BatchStatus, TERMINAL_BATCH_STATUSES

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)

PAGE_ROWS = 50  # batches per page of the list
STATUSES = [status.value for status in BatchStatus]
TERMINAL = {status.value for status in TERMINAL_BATCH_STATUSES}
# A batch's states in the order they happen, with the field holding when each began.
TIMELINE = [
    ("created", "created_at"),
    ("in_progress", "in_progress_at"),
    ("finalizing", "finalizing_at"),
    ("cancelling", "cancelling_at"),
    ("completed", "completed_at"),
    ("failed", "failed_at"),
    ("expired", "expired_at"),
    ("cancelled", "cancelled_at"),
]
StatusFilter = Annotated[BatchStatus | None, Query()]


def batch_rows(reads: ReadEngineDep, project_id: str, status: BatchStatus | None, after: str | None) -> dict[str, Any]:
    with reads.connect() as connection:
        listed = batches.list_batches(connection, project_id, after=after, limit=PAGE_ROWS, status=status)
    return {
        "batches": [BatchObject.of(row) for row in listed.rows],
        "has_more": listed.has_more,
        "status": status.value if status else "",
        "after": after,
        "terminal": TERMINAL,
    }


@router.get("/batches", response_class=HTMLResponse)
def batch_list(
    request: Request, reads: ReadEngineDep, viewer: ViewerDep, status: StatusFilter = None, after: str | None = None
) -> HTMLResponse:
    return page(request, "batches.html", viewer, statuses=STATUSES, **batch_rows(reads, viewer.project_id, status, after))


@router.get("/batches/live", response_class=HTMLResponse)
def batch_list_live(
    request: Request, reads: ReadEngineDep, viewer: ViewerDep, status: StatusFilter = None, after: str | None = None
) -> HTMLResponse:
    return page(request, "batch_rows.html", viewer, **batch_rows(reads, viewer.project_id, status, after))


def batch_view(
    reads: ReadEngineDep, sessions: ReadSessionsDep, store: StoreDep, project_id: str, batch_id: str
) -> dict[str, Any]:
    """A batch's page: the object, its timeline and, once it has an error file, its first failed lines."""
    with reads.connect() as connection:
        batch = BatchObject.of(batches.get_batch(connection, project_id, batch_id))
    timeline = [(state, getattr(batch, field)) for state, field in TIMELINE if getattr(batch, field) is not None]
    errors = None
    if batch.error_file_id is not None:
        errors = first_errors(sessions, store, project_id, batch.error_file_id, batch.input_file_id)
    return {"batch": batch, "timeline": timeline, "terminal": batch.status in TERMINAL, "errors": errors}


@router.get("/batches/{batch_id}", response_class=HTMLResponse)
def batch_page(
    request: Request, batch_id: str, reads: ReadEngineDep, sessions: ReadSessionsDep, store: StoreDep, viewer: ViewerDep
) -> HTMLResponse:
    return page(request, "batch.html", viewer, **batch_view(reads, sessions, store, viewer.project_id, batch_id))


@router.get("/batches/{batch_id}/live", response_class=HTMLResponse)
def batch_live(
    request: Request, batch_id: str, reads: ReadEngineDep, sessions: ReadSessionsDep, store: StoreDep, viewer: ViewerDep
) -> HTMLResponse:
    return page(request, "batch_live.html", viewer, **batch_view(reads, sessions, store, viewer.project_id, batch_id))


@router.get("/batches/{batch_id}/cancel", response_class=HTMLResponse)
def confirm_cancel(request: Request, batch_id: str, reads: ReadEngineDep, viewer: ViewerDep) -> HTMLResponse:
    with reads.connect() as connection:
        batch = batches.get_batch(connection, viewer.project_id, batch_id)
    return confirm_page(
        request,
        viewer,
        f"Cancel batch {batch.id}?",
        "Requests not yet answered are dropped; the answers so far stay in its output file.",
        "Cancel the batch",
        f"/console/batches/{batch.id}",
    )


@router.post("/batches/{batch_id}/cancel")
def cancel(
    batch_id: str, sessions: WriteSessionsDep, stop_flags: StopFlagsDep, viewer: FormViewerDep
) -> RedirectResponse:
    cancel_job(sessions, stop_flags, viewer.project_id, batch_id)
    return RedirectResponse(f"/console/batches/{batch_id}", status_code=303)


@router.get("/rag", response_class=HTMLResponse)
def rag_jobs(request: Request, reads: ReadEngineDep, viewer: ViewerDep, after: str | None = None) -> HTMLResponse:
    with reads.connect() as connection:
        listed = batches.list_batches(connection, viewer.project_id, after=after, limit=PAGE_ROWS, rag_job=True)
    jobs = [RagJobObject.of(row) for row in listed.rows]
    return page(request, "rag.html", viewer, jobs=jobs, has_more=listed.has_more)
