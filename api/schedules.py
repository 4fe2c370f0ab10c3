"""/v1/schedules: recurring batches and RAG jobs. Create, list, retrieve, pause, resume, delete, and the runs each
one fired."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.auth import ProjectDep
from api.deps import ReadSessionsDep, SettingsDep, WriteSessionsDep
from api.schemas import CreateSchedule, DeletedSchedule, ListPage, ScheduleObject, ScheduleRunObject
from jobs.schedules import definitions as schedules
from jobs.pagination import MAX_PAGE_SIZE

router = APIRouter(prefix="/v1/schedules", tags=["schedules"])

PageLimit = Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)]


@router.post("", response_model=ScheduleObject)
def create_schedule(
    body: CreateSchedule, sessions: WriteSessionsDep, settings: SettingsDep, project_id: ProjectDep
) -> ScheduleObject:
    spec = body.spec()
    with sessions.begin() as session:
        schedule = schedules.create_schedule(session, project_id, spec, embedding_model=settings.embedding_model)
    return ScheduleObject.of(schedule, settings.s3)


@router.get("", response_model=ListPage[ScheduleObject])
def list_schedules(
    sessions: ReadSessionsDep,
    settings: SettingsDep,
    project_id: ProjectDep,
    after: str | None = None,
    limit: PageLimit = 20,
) -> ListPage[ScheduleObject]:
    with sessions() as session:
        page = schedules.list_schedules(session, project_id, after=after, limit=limit)
    return ListPage.of([ScheduleObject.of(row, settings.s3) for row in page.rows], page.has_more)


@router.get("/{schedule_id}", response_model=ScheduleObject)
def retrieve_schedule(
    schedule_id: str, sessions: ReadSessionsDep, settings: SettingsDep, project_id: ProjectDep
) -> ScheduleObject:
    with sessions() as session:
        return ScheduleObject.of(schedules.get_schedule(session, project_id, schedule_id), settings.s3)


@router.post("/{schedule_id}/pause", response_model=ScheduleObject)
def pause_schedule(
    schedule_id: str, sessions: WriteSessionsDep, settings: SettingsDep, project_id: ProjectDep
) -> ScheduleObject:
    with sessions.begin() as session:
        schedule = schedules.set_paused(session, project_id, schedule_id, paused=True)
    return ScheduleObject.of(schedule, settings.s3)


@router.post("/{schedule_id}/resume", response_model=ScheduleObject)
def resume_schedule(
    schedule_id: str, sessions: WriteSessionsDep, settings: SettingsDep, project_id: ProjectDep
) -> ScheduleObject:
    with sessions.begin() as session:
        schedule = schedules.set_paused(session, project_id, schedule_id, paused=False)
    return ScheduleObject.of(schedule, settings.s3)


@router.delete("/{schedule_id}", response_model=DeletedSchedule)
def delete_schedule(schedule_id: str, sessions: WriteSessionsDep, project_id: ProjectDep) -> DeletedSchedule:
    with sessions.begin() as session:
        schedules.delete_schedule(session, project_id, schedule_id)
    return DeletedSchedule(id=schedule_id)


@router.get("/{schedule_id}/runs", response_model=ListPage[ScheduleRunObject])
def list_runs(
    schedule_id: str,
    sessions: ReadSessionsDep,
    project_id: ProjectDep,
    after: str | None = None,
    limit: PageLimit = 20,
) -> ListPage[ScheduleRunObject]:
    with sessions() as session:
        page = schedules.list_runs(session, project_id, schedule_id, after=after, limit=limit)
    return ListPage.of([ScheduleRunObject.of(row) for row in page.rows], page.has_more)
