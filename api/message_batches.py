"""/v1/messages/batches: Anthropic's Message Batches API (create, retrieve, list, cancel, delete, results), a second
face of the batch store (`jobs.message_batches`), authenticated by `x-api-key` with the projects' keys, errors in
Anthropic's shape (api/errors.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Row

from api.auth import AnthropicProjectDep
from api.creation import start_validation
from api.deps import ReadEngineDep, SettingsDep, StopFlagsDep, StoreDep, WriteSessionsDep
from api.schemas import answer
from jobs import enqueue, message_batches
from jobs.models import Batch
from jobs.pagination import MAX_PAGE_SIZE
from jobs.stop_flags import StopReason

router = APIRouter(prefix="/v1/messages/batches", tags=["message batches"])


class MessageBatchRequestCounts(BaseModel):
    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


class MessageBatchObject(BaseModel):
    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: message_batches.ProcessingStatus
    request_counts: MessageBatchRequestCounts
    ended_at: datetime | None
    created_at: datetime
    expires_at: datetime
    archived_at: datetime | None = None  # results are kept until the batch is deleted: none is ever archived
    cancel_initiated_at: datetime | None
    results_url: str | None  # once the batch has ended

    @classmethod
    def of(cls, row: Row[Any] | Batch, request: Request) -> "MessageBatchObject":
        status = message_batches.processing_status(row.status)
        results_url = str(request.url_for("message_batch_results", message_batch_id=row.id)) if status == "ended" else None
        counts = message_batches.request_counts(row)
        return cls(
            id=row.id,
            processing_status=status,
            request_counts=MessageBatchRequestCounts(**vars(counts)),
            ended_at=message_batches.ended_at(row),
            created_at=row.created_at,
            expires_at=row.expires_at,
            cancel_initiated_at=row.cancelling_at,
            results_url=results_url,
        )


class CreateMessageBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests: list[dict[str, Any]] = Field(
        min_length=1,
        description="`{custom_id, params}` each: `params` is a Messages API request (docs/anthropic_compatibility.md)"
    )


class MessageBatchPage(BaseModel):
    data: list[MessageBatchObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class DeletedMessageBatch(BaseModel):
    id: str
    type: Literal["message_batch_deleted"] = "message_batch_deleted"


@router.post("", response_model=MessageBatchObject)
def create_message_batch(
    body: CreateMessageBatch,
    request: Request,
    sessions: WriteSessionsDep,
    store: StoreDep,
    settings: SettingsDep,
    project_id: AnthropicProjectDep,
) -> MessageBatchObject:
    with sessions.begin() as session:
        batch = message_batches.create_message_batch(
            session,
            store,
            project_id,
            body.requests,
            settings.message_batch_limits(),
            settings.completion_window_seconds,
        )
        created = MessageBatchObject.of(batch, request)
    start_validation(sessions, created.id)
    return created


@router.get("/{message_batch_id}", response_model=MessageBatchObject)
def retrieve_message_batch(
    message_batch_id: str, request: Request, reads: ReadEngineDep, project_id: AnthropicProjectDep
) -> Response:
    with reads.connect() as connection:
        row = message_batches.get_message_batch(connection, project_id, message_batch_id)
    return answer(MessageBatchObject.of(row, request))


@router.get("", response_model=MessageBatchPage)
def list_message_batches(
    request: Request,
    reads: ReadEngineDep,
    project_id: AnthropicProjectDep,
    before_id: str | None = None,
    after_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 20,
) -> Response:
    with reads.connect() as connection:
        page = message_batches.list_message_batches(
            connection, project_id, before_id=before_id, after_id=after_id, limit=limit
        )
    data = [MessageBatchObject.of(row, request) for row in page.rows]
    return answer(
        MessageBatchPage(
            data=data,
            has_more=page.has_more,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
        )
    )


@router.post("/{message_batch_id}/cancel", response_model=MessageBatchObject)
def cancel_message_batch(
    message_batch_id: str,
    request: Request,
    sessions: WriteSessionsDep,
    stop_flags: StopFlagsDep,
    project_id: AnthropicProjectDep,
) -> MessageBatchObject:
    with sessions.begin() as session:
        batch, finalize_now = message_batches.cancel_message_batch(session, project_id, message_batch_id)
        canceled = MessageBatchObject.of(batch, request)
    if finalize_now:
        stop_flags.raise_flag(message_batch_id, StopReason.cancelled)  # running chunks abort their requests on seeing it
        enqueue.finalize(message_batch_id)
    return canceled


@router.delete("/{message_batch_id}", response_model=DeletedMessageBatch)
def delete_message_batch(
    message_batch_id: str, sessions: WriteSessionsDep, store: StoreDep, project_id: AnthropicProjectDep
) -> DeletedMessageBatch:
    with sessions() as session:
        message_batches.delete_message_batch(session, store, project_id, message_batch_id)
    return DeletedMessageBatch(id=message_batch_id)


@router.get(
    "/{message_batch_id}/results",
    name="message_batch_results",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "One JSON line per request: its custom_id and result",
            "content": {"application/x-jsonl": {"schema": {"type": "string"}}},
        }
    },
)
def message_batch_results(
    message_batch_id: str, reads: ReadEngineDep, store: StoreDep, project_id: AnthropicProjectDep
) -> StreamingResponse:
    with reads.connect() as connection:
        row = message_batches.get_message_batch(connection, project_id, message_batch_id)
    return StreamingResponse(message_batches.result_lines(store, row), media_type="application/x-jsonl")
