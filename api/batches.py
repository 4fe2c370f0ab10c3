"""/v1/batches: create, retrieve, list, cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from sqlalchemy.orm import Session

from api.auth import ProjectDep
from api.creation import IdempotencyKeyHeader, create_once, start_validation
from api.deps import ReadEngineDep, SettingsDep, StopFlagsDep, WriteSessionsDep
from api.schemas import BatchObject, CreateBatch, ListPage, answer
from jobs import batches, enqueue
from jobs.db import SessionFactory
from jobs.models import Batch
from jobs.pagination import MAX_PAGE_SIZE
from jobs.stop_flags import StopFlags, StopReason

router = APIRouter(prefix="/v1/batches", tags=["batches"])


@router.post("", response_model=BatchObject)
def create_batch(
    body: CreateBatch,
    sessions: WriteSessionsDep,
    settings: SettingsDep,
    project_id: ProjectDep,
    idempotency_key: IdempotencyKeyHeader = None,
) -> BatchObject:
    def create(session: Session) -> BatchObject:
        batch = batches.create_batch(
            session,
            project_id,
            input_file_id=body.input_file_id,
            endpoint=body.endpoint,
            completion_window=body.completion_window,
            metadata=body.metadata,
            priority=body.priority,
            window_seconds=settings.completion_window_seconds,
            output_expires_after_seconds=body.output_expires_after.seconds if body.output_expires_after else None,
            max_input_bytes=settings.max_batch_input_bytes,
        )
        return BatchObject.of(batch)

    answer, created = create_once(
        sessions, project_id, idempotency_key, "POST /v1/batches", body.model_dump(mode="json"), BatchObject, create
    )
    if created:
        start_validation(sessions, answer.id)
    return answer


@router.get("/{batch_id}", response_model=BatchObject)
def retrieve_batch(batch_id: str, reads: ReadEngineDep, project_id: ProjectDep) -> Response:
    with reads.connect() as connection:
        return answer(BatchObject.of(batches.get_batch(connection, project_id, batch_id)))


@router.get("", response_model=ListPage[BatchObject])
def list_batches(
    reads: ReadEngineDep,
    project_id: ProjectDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 20,
) -> Response:
    with reads.connect() as connection:
        page = batches.list_batches(connection, project_id, after=after, limit=limit)
    return answer(ListPage.of([BatchObject.of(row) for row in page.rows], page.has_more))


@router.post("/{batch_id}/cancel", response_model=BatchObject)
def cancel_batch(
    batch_id: str, sessions: WriteSessionsDep, stop_flags: StopFlagsDep, project_id: ProjectDep
) -> BatchObject:
    return BatchObject.of(cancel_job(sessions, stop_flags, project_id, batch_id))


def cancel_job(
    sessions: SessionFactory, stop_flags: StopFlags, project_id: str, job_id: str, *, rag_job: bool = False
) -> Batch:
    """Cancel a batch or RAG job: what /v1/batches, /v1/rag/jobs and the console's cancel button do."""
    with sessions.begin() as session:
        job, finalize_now = batches.request_cancel(session, project_id, job_id, rag_job=rag_job)
    if finalize_now:
        # Running chunks abort their requests (a RAG job's stop between documents) on seeing it.
        stop_flags.raise_flag(job.id, StopReason.cancelled)
        enqueue.finalize(job.id)
    return job
