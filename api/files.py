"""/v1/files: upload (streamed to S3), list, retrieve, download (streamed), delete."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.auth import ProjectDep
from api.deps import ReadSessionsDep, SettingsDep, StoreDep, WriteSessionsDep
from api.schemas import DeletedFile, FileObject, ListPage
from api.upload import receive_form
from jobs import files
from jobs.errors import ServiceError
from jobs.models import new_id
from jobs.object_keys import file_key
from jobs.pagination import MAX_PAGE_SIZE

router = APIRouter(prefix="/v1/files", tags=["files"])

MULTIPART_OVERHEAD_BYTES = 64 * 1024  # boundaries and part headers around the file itself


@router.post(
    "",
    response_model=FileObject,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["file", "purpose"],
                        "properties": {
                            "file": {"type": "string", "format": "binary"},
                            "purpose": {"type": "string", "enum": [p.value for p in files.UPLOADABLE_PURPOSES]},
                        },
                    }
                }
            },
        }
    },
)
async def upload_file(
    request: Request, sessions: WriteSessionsDep, store: StoreDep, settings: SettingsDep, project_id: ProjectDep
) -> FileObject:
    declared = int(request.headers.get("content-length") or 0)
    if declared > settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES:
        raise ServiceError(
            "too_large",
            f"the file is larger than this server's limit of {settings.max_upload_bytes} bytes",
            param="file",
        )
    file_id = new_id("file-")
    key = file_key(project_id, file_id)
    upload = await run_in_threadpool(store.upload_stream, key)
    try:
        form = await receive_form(request, upload, settings.max_upload_bytes)
        purpose = files.parse_upload_purpose(form.fields.get("purpose"))
        await run_in_threadpool(upload.complete)
    except BaseException:
        await run_in_threadpool(upload.abort)
        raise

    def record() -> FileObject:
        with sessions.begin() as session:
            row = files.record_file(
                session,
                file_id=file_id,
                project_id=project_id,
                filename=form.filename,
                purpose=purpose,
                size=form.size,
                object_key=key,
            )
        return FileObject.of(row)

    return await run_in_threadpool(record)


@router.get("", response_model=ListPage[FileObject])
def list_files(
    sessions: ReadSessionsDep,
    project_id: ProjectDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = MAX_PAGE_SIZE,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> ListPage[FileObject]:
    with sessions() as session:
        page = files.list_files(session, project_id, after=after, limit=limit, order=order, purpose=purpose)
    data = [FileObject.of(row) for row in page.rows]
    return ListPage.of(data, page.has_more)


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(file_id: str, sessions: ReadSessionsDep, project_id: ProjectDep) -> FileObject:
    with sessions() as session:
        return FileObject.of(files.get_file(session, project_id, file_id))


@router.get("/{file_id}/content", response_class=StreamingResponse)
def download_file(file_id: str, sessions: ReadSessionsDep, store: StoreDep, project_id: ProjectDep) -> StreamingResponse:
    with sessions() as session:
        row = files.get_file(session, project_id, file_id)
    return StreamingResponse(
        store.open_stream(row.object_key),
        media_type="application/octet-stream",
        headers={"content-length": str(row.bytes), "content-disposition": f'attachment; filename="{row.filename}"'},
    )


@router.delete("/{file_id}", response_model=DeletedFile)
def delete_file(file_id: str, sessions: WriteSessionsDep, store: StoreDep, project_id: ProjectDep) -> DeletedFile:
    with sessions() as session:
        files.delete_file(session, store, project_id, file_id)
    return DeletedFile(id=file_id)
