"""Request and response bodies, shaped like OpenAI's Files and Batches objects."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from fastapi import Response
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from jobs.files import MAX_EXPIRY_SECONDS, MIN_EXPIRY_SECONDS
from jobs.openai_format.requests import Endpoint
from jobs.batches import MAX_METADATA_KEY_CHARS, MAX_METADATA_PAIRS, MAX_METADATA_VALUE_CHARS, MAX_PRIORITY, MIN_PRIORITY
from jobs.models import Batch, File, Schedule, ScheduleFire, WebhookAttempt, WebhookEndpoint
from jobs.rag.jobs import RagJobSpec, has_manifest, manifest_file_id
from jobs.schedules.definitions import ScheduleSpec, ScheduleTemplate, inbox_uri, run_id
from jobs.settings import S3Settings
from jobs.webhooks.signing import secret_hint
from jobs.webhooks.endpoints import ENDPOINT_NAME_MAX_LENGTH, DeliveryHistory

ItemT = TypeVar("ItemT")


def _unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def answer(body: BaseModel) -> Response:
    """`body` as the JSON answer, serialized once. A route returning the model itself has FastAPI validate it a
    second time against its `response_model` first; the routes clients poll answer this way instead (their
    decorator's `response_model` still documents the answer)."""
    return Response(body.model_dump_json(), media_type="application/json")


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None

    @classmethod
    def of(cls, row: File) -> "FileObject":
        return cls(
            id=row.id,
            bytes=row.bytes,
            created_at=int(row.created_at.timestamp()),
            filename=row.filename,
            purpose=row.purpose.value,
            expires_at=_unix(row.expires_at),
        )


class DeletedFile(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ListPage(BaseModel, Generic[ItemT]):
    object: Literal["list"] = "list"
    data: list[ItemT]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, data: list[ItemT], has_more: bool) -> "ListPage[ItemT]":
        ids = [getattr(item, "id") for item in data]
        return cls(data=data, first_id=ids[0] if ids else None, last_id=ids[-1] if ids else None, has_more=has_more)


class ExpiresAfter(BaseModel):
    """OpenAI's `expires_after`: `seconds` after the file's creation (the only anchor OpenAI has)."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRY_SECONDS, le=MAX_EXPIRY_SECONDS)


MetadataKey = Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)]
MetadataValue = Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_PAIRS)]


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: Metadata | None = None
    output_expires_after: ExpiresAfter | None = None  # the output and error files' lifetime; None: kept until deleted
    # Not in OpenAI's API (SDKs send it with extra_body): lower runs first.
    priority: int = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV the engine's prefix cache already held


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # no served model reasons apart from its answer


class BatchUsage(BaseModel):
    """OpenAI's Batch `usage`: the answered lines' tokens, kept current as chunks finish."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class BatchErrorEntry(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorEntry]


class JobLifecycle(BaseModel):
    """What every job object shows of its run: a batch's and a RAG job's status, counts, files and timestamps."""

    id: str
    status: str
    errors: BatchErrors | None
    input_file_id: str
    output_file_id: str | None
    error_file_id: str | None
    request_counts: RequestCounts
    completion_window: str
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    metadata: dict[str, str] | None = Field(default=None)
    priority: int = 0

    @staticmethod
    def fields_of(row: Batch) -> dict[str, Any]:
        """The lifecycle fields of a batch row (an ORM object or a Core row with its attribute names)."""
        errors: list[dict[str, Any]] | None = row.errors
        return dict(
            id=row.id,
            status=row.status.value,
            errors=BatchErrors(data=[BatchErrorEntry(**entry) for entry in errors]) if errors else None,
            input_file_id=row.input_file_id,
            output_file_id=row.output_file_id,
            error_file_id=row.error_file_id,
            request_counts=RequestCounts(
                total=row.total_requests, completed=row.completed_requests, failed=row.failed_requests
            ),
            completion_window=row.completion_window,
            created_at=int(row.created_at.timestamp()),
            in_progress_at=_unix(row.in_progress_at),
            expires_at=_unix(row.expires_at),
            finalizing_at=_unix(row.finalizing_at),
            completed_at=_unix(row.completed_at),
            failed_at=_unix(row.failed_at),
            expired_at=_unix(row.expired_at),
            cancelling_at=_unix(row.cancelling_at),
            cancelled_at=_unix(row.cancelled_at),
            metadata=row.batch_metadata,
            priority=row.priority,
        )


class BatchObject(JobLifecycle):
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None  # the served model its lines resolve to (set when validation starts)
    usage: BatchUsage | None = None

    @classmethod
    def of(cls, row: Batch) -> "BatchObject":
        return cls(
            **cls.fields_of(row),
            endpoint=row.endpoint,
            model=row.model,
            usage=BatchUsage(
                input_tokens=row.input_tokens or 0,
                input_tokens_details=InputTokensDetails(cached_tokens=row.cached_tokens or 0),
                output_tokens=row.output_tokens or 0,
                output_tokens_details=OutputTokensDetails(),
                total_tokens=(row.input_tokens or 0) + (row.output_tokens or 0),
            ),
        )


class RagJobOptions(BaseModel):
    """How documents become chunks; a field left out takes its default (shown on the created job)."""

    model_config = ConfigDict(extra="forbid")

    chunk_tokens: int | None = Field(default=None, description="embedding-model tokens per chunk (default 254)")
    overlap_tokens: int | None = Field(default=None, description="tokens a chunk may share with the next (32)")
    contextualize: bool | None = Field(default=None, description="prefix each chunk with a generated context")
    context_prompt: str | None = Field(default=None, description="template with {document} and {chunk}")
    context_max_tokens: int | None = Field(default=None, description="generated tokens per context (96)")
    embedding_model: str | None = Field(default=None, description="must be the service's (the default)")
    pdf_mode: Literal["text", "pages"] | None = Field(
        default=None,
        description="PDFs read by their text layer ('text', the default) or as pages transcribed to Markdown by the "
        "deployment's vision-language model ('pages': the job is bound to a served model that reads images, shown as "
        "its `model`; a deployment serving none refuses it with model_not_multimodal)",
    )
    page_dpi: int | None = Field(default=None, description="resolution pages are rendered at, 36 to 300 (144)")
    page_max_tokens: int | None = Field(default=None, description="generated tokens per page's transcription (1024)")


class CreateRagJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str | None = Field(default=None, description="a JSONL file of document lines; or input_prefix")
    input_prefix: str | None = Field(
        default=None, description="every object under this prefix of the project's inbox, listed at creation"
    )
    options: RagJobOptions = Field(default_factory=RagJobOptions)
    metadata: dict[str, str] | None = None
    completion_window: str = "24h"
    priority: int = Field(default=0, description="engine priority of the job's context generation: lower first")

    def spec(self) -> RagJobSpec:
        return RagJobSpec(
            input_file_id=self.input_file_id,
            input_prefix=self.input_prefix,
            options=self.options.model_dump(exclude_none=True),
            metadata=self.metadata,
            completion_window=self.completion_window,
            priority=self.priority,
        )


class RagJobObject(JobLifecycle):
    """A RAG preprocessing job; request_counts count documents. `input_file_id` is the uploaded file, or for
    input_prefix the listing of the prefix's objects; `output_file_id` is Parquet (one row per chunk) and
    `error_file_id` JSONL ({"doc_id", "error": {"code", "message"}} per document that failed)."""

    object: Literal["rag.job"] = "rag.job"
    options: dict[str, Any]
    input_prefix: str | None
    manifest_file_id: str | None  # JSON: options, counts, models, files
    # The served model its chunks run on: pdf_mode "pages" binds the job at creation to one that reads images; None:
    # any worker's (contexts, if any, are written by the model of the worker that takes each chunk)
    model: str | None = None

    @classmethod
    def of(cls, row: Batch) -> "RagJobObject":
        return cls(
            **cls.fields_of(row),
            options=row.rag_options or {},
            input_prefix=row.input_prefix,
            manifest_file_id=manifest_file_id(row.id) if has_manifest(row) else None,
            model=row.model,
        )


class CreateSchedule(ScheduleTemplate):
    model_config = ConfigDict(extra="forbid")

    rag_options: RagJobOptions | None = Field(default=None, description="POST /v1/rag/jobs's options")

    def spec(self) -> ScheduleSpec:
        return ScheduleSpec(
            **self.model_dump(exclude={"rag_options"}),
            rag_options=None if self.rag_options is None else self.rag_options.model_dump(exclude_none=True),
        )


class ScheduleObject(ScheduleTemplate):
    id: str
    object: Literal["schedule"] = "schedule"
    input_uri: str | None  # where the project's tools put the objects an input_prefix reads
    rag_options: dict[str, Any] | None  # a RAG template's options, defaults filled in; None for a batch template
    paused: bool
    next_fire_at: int
    created_at: int

    @classmethod
    def of(cls, row: Schedule, s3: S3Settings) -> "ScheduleObject":
        return cls(
            id=row.id,
            cron=row.cron,
            timezone=row.timezone,
            endpoint=row.endpoint,
            completion_window=row.completion_window,
            input_file_id=row.input_file_id,
            input_prefix=row.input_prefix,
            input_uri=None if row.input_prefix is None else inbox_uri(s3, row.project_id, row.input_prefix),
            metadata=row.batch_metadata,
            priority=row.priority,
            webhook_endpoint_id=row.webhook_endpoint_id,
            rag_options=row.rag_options,
            paused=row.paused,
            next_fire_at=int(row.next_fire_at.timestamp()),
            created_at=int(row.created_at.timestamp()),
        )


class DeletedSchedule(BaseModel):
    id: str
    object: Literal["schedule.deleted"] = "schedule.deleted"
    deleted: bool = True


class ScheduleRunObject(BaseModel):
    """One fire time of a schedule: the batch (or RAG job) it created, or why it could not."""

    id: str
    object: Literal["schedule.run"] = "schedule.run"
    schedule_id: str
    fire_time: int
    batch_id: str | None  # or the RAG job's id
    error: str | None
    created_at: int

    @classmethod
    def of(cls, row: ScheduleFire) -> "ScheduleRunObject":
        return cls(
            id=run_id(row.fire_time),
            schedule_id=row.schedule_id,
            fire_time=int(row.fire_time.timestamp()),
            batch_id=row.batch_id,
            error=row.error,
            created_at=int(row.created_at.timestamp()),
        )


EndpointName = Annotated[str, Field(min_length=1, max_length=ENDPOINT_NAME_MAX_LENGTH)]


class WebhookEndpointFields(BaseModel):
    """OpenAI's webhook endpoint fields, as an endpoint has them; the request bodies below take each as optional."""

    url: str = Field(description="http(s) URL that receives the events; must resolve to a public address")
    name: EndpointName
    event_types: list[str] = Field(description="the batch.* event types sent to it")


class UpdateWebhookEndpoint(BaseModel):
    """OpenAI's webhook endpoint fields (`WebhookEndpointFields`); what is left out is kept."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(default=None, description="http(s) URL that receives the events; must resolve publicly")
    name: EndpointName | None = None
    # `events` is the name /v1/webhooks was first specified with; OpenAI's SDK sends `event_types`.
    event_types: list[str] | None = Field(
        default=None,
        validation_alias=AliasChoices("event_types", "events"),
        description="batch.* event types to send (also accepted as `events`); an update replaces the whole set",
    )


class CreateWebhookEndpoint(UpdateWebhookEndpoint):
    """Left out: `name` is the URL's host and path, `event_types` every batch.* type."""

    url: str = Field(description="http(s) URL that receives the events; must resolve to a public address")


class RotateWebhookSecret(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_old_secret_active_for_24_hours: bool = False


class WebhookEndpointObject(WebhookEndpointFields):
    """OpenAI's WebhookEndpoint."""

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    signing_secret_hint: str
    created_at: int
    updated_at: int

    @classmethod
    def of(cls, row: WebhookEndpoint) -> "WebhookEndpointObject":
        return cls(
            id=row.id,
            url=row.url,
            name=row.name,
            event_types=row.events,
            signing_secret_hint=secret_hint(row.secret),
            created_at=int(row.created_at.timestamp()),
            updated_at=int(row.updated_at.timestamp()),
        )


class WebhookEndpointWithSecret(WebhookEndpointObject):
    """OpenAI's WebhookEndpointWithSecret: the answers to create and rotate_secret, the only ones that show it."""

    signing_secret: str

    @classmethod
    def of(cls, row: WebhookEndpoint) -> "WebhookEndpointWithSecret":
        return cls(**WebhookEndpointObject.of(row).model_dump(), signing_secret=row.secret)


class DeletedWebhookEndpoint(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class WebhookAttemptObject(BaseModel):
    number: int
    started_at: float  # unix seconds, fractional: retries may be less than a second apart
    latency_ms: float
    status_code: int | None  # None: no HTTP answer (refused, unreachable, timed out)
    error: str | None
    succeeded: bool

    @classmethod
    def of(cls, row: WebhookAttempt) -> "WebhookAttemptObject":
        return cls(
            number=row.number,
            started_at=row.started_at.timestamp(),
            latency_ms=round(row.latency_ms, 1),
            status_code=row.status_code,
            error=row.error,
            succeeded=row.succeeded,
        )


class WebhookDeliveryObject(BaseModel):
    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    event_id: str
    event_type: str
    batch_id: str
    status: str  # pending (attempts remain), succeeded, failed (every attempt failed)
    attempts: list[WebhookAttemptObject]
    next_attempt_at: int | None
    created_at: int
    finished_at: int | None

    @classmethod
    def of(cls, history: DeliveryHistory) -> "WebhookDeliveryObject":
        delivery, event = history.delivery, history.event
        return cls(
            id=delivery.id,
            event_id=event.id,
            event_type=event.type,
            batch_id=event.batch_id,
            status=delivery.status.value,
            attempts=[WebhookAttemptObject.of(attempt) for attempt in history.attempts],
            next_attempt_at=_unix(delivery.next_attempt_at),
            created_at=int(delivery.created_at.timestamp()),
            finished_at=_unix(delivery.finished_at),
        )
