"""/v1/files: upload (streamed to S3), list, retrieve, download (streamed), delete."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from sqlalchemy.orm import Session

from api.auth import ProjectDep
from api.creation import IdempotencyKeyHeader, create_once
from api.deps import ReadEngineDep, ReadSessionsDep, SettingsDep, StoreDep, WriteSessionsDep
from api.schemas import DeletedFile, FileObject, ListPage, answer
from api.upload import FormLimits, UploadedForm, receive_form
from jobs import files, idempotency
from jobs.errors import ServiceError
from jobs.db import SessionFactory
from jobs.models import FilePurpose, new_id, utcnow
from jobs.object_keys import file_key
from jobs.pagination import MAX_PAGE_SIZE
from jobs.storage import ObjectStore

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
                        "additionalProperties": False,
                        "properties": {
                            "file": {"type": "string", "format": "binary"},
                            "purpose": {"type": "string", "enum": [p.value for p in files.UPLOADABLE_PURPOSES]},
                            "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                            "expires_after[seconds]": {
                                "type": "integer",
                                "minimum": files.MIN_EXPIRY_SECONDS,
                                "maximum": files.MAX_EXPIRY_SECONDS,
                            },
                        },
                        # OpenAI's expires_after is one object: its anchor and seconds come together.
                        "dependentRequired": {
                            "expires_after[anchor]": ["expires_after[seconds]"],
                            "expires_after[seconds]": ["expires_after[anchor]"],
                        },
                    }
                }
            },
        }
    },
)
async def upload_file(
    request: Request,
    sessions: WriteSessionsDep,
    store: StoreDep,
    settings: SettingsDep,
    project_id: ProjectDep,
    idempotency_key: IdempotencyKeyHeader = None,
) -> FileObject:
    declared = request.headers.get("content-length") or "0"
    if not declared.isdigit():
        raise ServiceError("invalid_request", f"Content-Length must be a number of bytes, got {declared!r}")
    if int(declared) > settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES:
        raise ServiceError(
            "too_large",
            f"the file is larger than this server's limit of {settings.max_upload_bytes} bytes",
            param="file",
        )
    limits = FormLimits(
        max_file_bytes=settings.max_upload_bytes,
        max_field_bytes=settings.max_form_field_bytes,
        max_header_bytes=settings.max_form_part_header_bytes,
    )
    if idempotency_key is not None and await run_in_threadpool(_key_used, sessions, project_id, idempotency_key):
        # A retry: its file is read to compare with the first one, and stored nowhere.
        form = await receive_form(request, _Discard(), limits)
        return await run_in_threadpool(_record_once, sessions, store, project_id, idempotency_key, form, None)
    file_id = new_id("file-")
    key = file_key(project_id, file_id)
    upload = await run_in_threadpool(store.upload_stream, key)
    try:
        form = await receive_form(request, upload, limits)
        files.parse_upload_purpose(form.fields.get("purpose"))  # refused before the bytes are kept
        files.upload_expiry(form.fields, utcnow())
        await run_in_threadpool(upload.complete)
    except BaseException:
        await run_in_threadpool(upload.abort)
        raise
    return await run_in_threadpool(_record_once, sessions, store, project_id, idempotency_key, form, (file_id, key))


class _Discard:
    def write(self, data: bytes) -> None:
        pass


def _key_used(sessions: SessionFactory, project_id: str, key: str) -> bool:
    with sessions() as session:
        return idempotency.key_exists(session, project_id, key)


def _record_once(
    sessions: SessionFactory,
    store: ObjectStore,
    project_id: str,
    idempotency_key: str | None,
    form: UploadedForm,
    uploaded: tuple[str, str] | None,
) -> FileObject:
    """Record the uploaded file (id, object key), or answer the first upload made with this idempotency key; an
    upload that turns out to be a retry is deleted from the store."""
    purpose = files.parse_upload_purpose(form.fields.get("purpose"))
    created_at = utcnow()
    expires_at = files.upload_expiry(form.fields, created_at)
    parameters = {
        "purpose": purpose.value,
        "filename": form.filename,
        "bytes": form.size,
        "sha256": form.sha256,
        "expires_after_seconds": None if expires_at is None else (expires_at - created_at).total_seconds(),
    }

    def create(session: Session) -> FileObject:
        if uploaded is None:  # the key was used, but with another file (replay raised 409 before this) or has expired
            raise ServiceError(
                "conflict", f"{idempotency.HEADER} {idempotency_key!r} expired meanwhile; retry", code="idempotency_retry"
            )
        file_id, key = uploaded
        row = files.record_file(
            session,
            file_id=file_id,
            project_id=project_id,
            filename=form.filename,
            purpose=purpose,
            size=form.size,
            object_key=key,
            created_at=created_at,
            expires_at=expires_at,
        )
        return FileObject.of(row)

    try:
        answer, created = create_once(
            sessions, project_id, idempotency_key, "POST /v1/files", parameters, FileObject, create
        )
    except Exception:  # not recorded (a file name PostgreSQL cannot store, say): its bytes go too
        if uploaded is not None:
            store.delete(uploaded[1])
        raise
    if not created and uploaded is not None:
        store.delete(uploaded[1])
    return answer


@router.get("", response_model=ListPage[FileObject])
def list_files(
    reads: ReadEngineDep,
    project_id: ProjectDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = MAX_PAGE_SIZE,
    order: Literal["asc", "desc"] = "desc",
    purpose: FilePurpose | None = None,
) -> Response:
    with reads.connect() as connection:
        page = files.list_files(
            connection, project_id, after=after, limit=limit, order=order, purpose=None if purpose is None else purpose.value
        )
    return answer(ListPage.of([FileObject.of(row) for row in page.rows], page.has_more))


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(file_id: str, sessions: ReadSessionsDep, project_id: ProjectDep) -> FileObject:
    with sessions() as session:
        return FileObject.of(files.get_file(session, project_id, file_id))


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "The file's bytes",
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
def download_file(file_id: str, sessions: ReadSessionsDep, store: StoreDep, project_id: ProjectDep) -> StreamingResponse:
    return file_content(sessions, store, project_id, file_id)


def file_content(sessions: SessionFactory, store: ObjectStore, project_id: str, file_id: str) -> StreamingResponse:
    """The file's bytes streamed from S3, as an attachment: the API's download and the console's."""
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
