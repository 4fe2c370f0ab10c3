"""/v1/rag/jobs: RAG preprocessing jobs. Create, retrieve, list, cancel; the work is the batch pipeline's."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from api.auth import ProjectDep
from api.batches import cancel_job
from api.creation import start_validation
from api.deps import ReadEngineDep, SettingsDep, StopFlagsDep, StoreDep, WriteSessionsDep
from api.schemas import CreateRagJob, ListPage, RagJobObject, answer
from jobs import batches
from jobs.pagination import MAX_PAGE_SIZE
from jobs.rag import jobs as rag_jobs
from jobs.served_models import ModelRegistry

router = APIRouter(prefix="/v1/rag/jobs", tags=["rag"])


@router.post("", response_model=RagJobObject)
def create_rag_job(
    body: CreateRagJob,
    request: Request,
    sessions: WriteSessionsDep,
    store: StoreDep,
    settings: SettingsDep,
    project_id: ProjectDep,
) -> RagJobObject:
    spec = body.spec()
    registry: ModelRegistry = request.app.state.models
    # Prepared before the transaction: no pooled connection waits on S3 or Redis.
    prepared = rag_jobs.prepare_rag_job(store, settings.s3, project_id, spec, settings.embedding_model, registry.served)
    with sessions.begin() as session:
        job = rag_jobs.add_rag_job(session, project_id, spec, prepared, settings.completion_window_seconds)
    start_validation(sessions, job.id)
    return RagJobObject.of(job)


@router.get("/{job_id}", response_model=RagJobObject)
def retrieve_rag_job(job_id: str, reads: ReadEngineDep, project_id: ProjectDep) -> Response:
    with reads.connect() as connection:
        return answer(RagJobObject.of(batches.get_batch(connection, project_id, job_id, rag_job=True)))


@router.get("", response_model=ListPage[RagJobObject])
def list_rag_jobs(
    reads: ReadEngineDep,
    project_id: ProjectDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 20,
) -> Response:
    with reads.connect() as connection:
        page = batches.list_batches(connection, project_id, after=after, limit=limit, rag_job=True)
    return answer(ListPage.of([RagJobObject.of(row) for row in page.rows], page.has_more))


@router.post("/{job_id}/cancel", response_model=RagJobObject)
def cancel_rag_job(
    job_id: str, sessions: WriteSessionsDep, stop_flags: StopFlagsDep, project_id: ProjectDep
) -> RagJobObject:
    return RagJobObject.of(cancel_job(sessions, stop_flags, project_id, job_id, rag_job=True))
