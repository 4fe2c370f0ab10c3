"""A batch's life after it is created: validate → run_chunk × N → finalize.

Celery only delivers these steps (`jobs.tasks`); the steps themselves live here, free of Celery, and each is
idempotent, because with late acknowledgement any of them may run again after a crash:

- validate reads the input once, writes an error record per bad line, then records the chunks and the
  batch's totals in one transaction before enqueueing the chunks. Run again, it re-enqueues pending chunks.
- run_chunk writes its errors object, then its output object; the output object's existence means the chunk
  is complete. Marking the chunk done and adding its counts to the batch is one conditional update, so the
  counts move exactly once. A re-delivered chunk whose output exists only marks it done; one whose output does
  not exist is redone from scratch. A Redis lease (renewed while it runs) keeps two workers off one chunk
  when Redis re-delivers a task whose worker is merely slow, not dead.
- finalize composes the chunk objects into one output and one error file by S3 multipart copy, under ids
  derived from the batch id, and sets the final status only if nobody did it first.

A RAG preprocessing job is a batch with endpoint `RAG_ENDPOINT` and takes the same steps with the same
bookkeeping; what differs (its input lines are documents, a chunk's output is a Parquet part, finalize merges
those and writes a manifest) is `jobs.rag.job_pipeline`'s, called where the kinds part ways.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from redis import Redis
from redis.exceptions import LockError, RedisError
from redis.lock import Lock
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from jobs.batch_format import (
    BatchLineValidator,
    BatchOutputLine,
    BatchRequest,
    EmbeddingRequest,
    LineError,
    PromptTokenizer,
    TextEmbedder,
    embedding_records,
    error_record,
    response_record,
)
from jobs.batches import RAG_ENDPOINT, has_pending_chunks
from jobs.db import SessionFactory
from jobs.models import Batch, BatchStatus, Chunk, ChunkStatus, File, FilePurpose, utcnow
from jobs.object_keys import (
    chunk_errors_key,
    chunk_output_key,
    expired_requests_key,
    file_key,
    validation_errors_key,
)
from jobs.settings import Settings
from jobs.stop_flags import StopFlags, StopReason
from jobs.storage import ObjectNotFound, ObjectStore
from jobs.webhooks import record_batch_event

if TYPE_CHECKING:  # the API imports the tasks, and through them this module, but runs no engine (nor torch)
    from engine.engine_loop import EngineLoop, RequestHandle
    from jobs.rag.job_pipeline import RagJobRunner

LineNumber = int
log = logging.getLogger(__name__)

# How often a chunk waiting on the engine looks at its batch's stop flag: a cancel reaches the engine this fast.
STOP_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class EngineHandle:
    """The worker's one engine, as the pipeline needs it."""

    loop: EngineLoop
    tokenizer: PromptTokenizer
    max_model_len: int
    model_name: str


@dataclass(frozen=True)
class RejectedLine:
    """An input line validate refused."""

    message: str  # "line N: why"
    record: bytes  # its JSONL error record for the error file, newline included
    not_json: bool  # not a JSON object at all: a file of nothing else is not JSONL and fails the batch


class InputLines(Protocol):
    """One kind of job's input lines (batch requests, RAG documents), as validate and finalize handle them."""

    @property
    def per_chunk(self) -> int: ...  # valid lines per chunk

    def check(self, line_number: LineNumber, line: bytes) -> RejectedLine | None: ...

    def expired_record(self, line: bytes) -> bytes: ...  # the error record of a valid line that never ran


class _RequestLines:
    """A batch's lines: OpenAI batch requests."""

    def __init__(self, validator: BatchLineValidator, per_chunk: int) -> None:
        self.validator = validator
        self.per_chunk = per_chunk

    def check(self, line_number: LineNumber, line: bytes) -> RejectedLine | None:
        checked = self.validator.validate(line)
        if not isinstance(checked, LineError):
            return None
        located = LineError(checked.custom_id, checked.code, f"line {line_number}: {checked.message}")
        return RejectedLine(located.message, _jsonl(error_record(located)), checked.code == "invalid_json_line")

    def expired_record(self, line: bytes) -> bytes:
        return _jsonl(_expired_record(json.loads(line)["custom_id"]))


class ChunkBusy(Exception):
    """Another worker holds this chunk's lease: try again once it has finished or its lease has lapsed."""


@dataclass
class _ChunkDraft:
    byte_start: int
    first_line: LineNumber
    byte_end: int = 0
    num_requests: int = 0
    rejected_lines: list[LineNumber] = field(default_factory=list)


@dataclass
class _ValidationTally:
    lines: int = 0
    valid: int = 0
    invalid: int = 0
    not_json: int = 0
    first_problem: str | None = None


def iter_lines(
    blocks: Iterable[bytes], first_line: LineNumber = 1, offset: int = 0
) -> Iterator[tuple[LineNumber, int, int, bytes]]:
    """(line number, start byte, end byte exclusive, line without its newline) for each line of a byte stream."""
    pending = b""
    pending_start = offset
    line_number = first_line
    for block in blocks:
        pending += block
        while (newline := pending.find(b"\n")) >= 0:
            line, pending = pending[:newline], pending[newline + 1 :]
            end = pending_start + newline + 1
            yield line_number, pending_start, end, line
            line_number += 1
            pending_start = end
    if pending:
        yield line_number, pending_start, pending_start + len(pending), pending


def derived_file_id(batch_id: str, role: str) -> str:
    """The id of a batch's output or error file: the same on every finalize attempt, so a retry cannot add a twin."""
    return "file-" + hashlib.sha256(f"{batch_id}/{role}".encode()).hexdigest()[:24]


class Pipeline:
    def __init__(
        self,
        *,
        settings: Settings,
        sessions: SessionFactory,
        store: ObjectStore,
        redis: Redis,
        engine: EngineHandle,
        embedder: TextEmbedder,
        rag: RagJobRunner,
        enqueue_run_chunk: Callable[[str, int, int], None],
        enqueue_finalize: Callable[[str], None],
        enqueue_webhook_deliveries: Callable[[list[str]], None],
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.store = store
        self.redis = redis
        self.stop_flags = StopFlags(redis, settings.redis_prefix)
        self.engine = engine
        self.embedder = embedder
        self.rag = rag
        self.enqueue_run_chunk = enqueue_run_chunk
        self.enqueue_finalize = enqueue_finalize
        self.enqueue_webhook_deliveries = enqueue_webhook_deliveries

    # -----------------------------------------------------------------------------------------------------
    # validate

    def validate(self, batch_id: str) -> None:
        with self.sessions() as session:
            batch = session.get(Batch, batch_id)
            if batch is None:
                return
            status, project_id, input_file_id, endpoint = (
                batch.status,
                batch.project_id,
                batch.input_file_id,
                batch.endpoint,
            )
        if status == BatchStatus.in_progress:  # a re-delivered validate: its chunks may not all have been enqueued
            self._enqueue_pending_chunks(batch_id)
            return
        if status not in (BatchStatus.validating, BatchStatus.cancelling):
            return

        lines = self._input_lines(endpoint, project_id)
        tally = _ValidationTally()
        chunks: list[_ChunkDraft] = []
        try:
            with self.store.upload_stream(validation_errors_key(batch_id)) as errors:
                chunks = self._split(
                    self.store.open_stream(file_key(project_id, input_file_id)), lines, tally, errors.write
                )
        except ObjectNotFound:  # the input's bytes are gone (deleted after the batch was created)
            self._fail(batch_id, "invalid_file", f"input file {input_file_id} no longer exists")
            return

        if tally.lines == 0:
            self._fail(batch_id, "empty_file", "the input file holds no requests")
            return
        if tally.not_json == tally.lines:
            self._fail(
                batch_id,
                "invalid_file_format",
                f"the input file is not JSONL: no line is a JSON object ({tally.first_problem})",
            )
            return
        self._record_chunks(batch_id, chunks, tally)

    def _input_lines(self, endpoint: str, project_id: str) -> InputLines:
        if endpoint == RAG_ENDPOINT:
            return self.rag.document_lines(project_id)
        validator = BatchLineValidator(self.engine.tokenizer, self.engine.max_model_len, endpoint)  # type: ignore[arg-type]
        return _RequestLines(validator, self.settings.chunk_size)

    def _split(
        self,
        blocks: Iterable[bytes],
        lines: InputLines,
        tally: _ValidationTally,
        write_error: Callable[[bytes], None],
    ) -> list[_ChunkDraft]:
        chunks: list[_ChunkDraft] = []
        draft: _ChunkDraft | None = None
        for line_number, start, end, line in iter_lines(blocks):
            if draft is None:
                draft = _ChunkDraft(byte_start=start, first_line=line_number)
            draft.byte_end = end
            if not line.strip():  # blank lines carry no request
                continue
            tally.lines += 1
            rejected = lines.check(line_number, line)
            if rejected is not None:
                tally.invalid += 1
                tally.not_json += rejected.not_json
                tally.first_problem = tally.first_problem or rejected.message
                write_error(rejected.record)
                draft.rejected_lines.append(line_number)
                continue
            tally.valid += 1
            draft.num_requests += 1
            if draft.num_requests == lines.per_chunk:
                chunks.append(draft)
                draft = None
        if draft is not None and draft.num_requests > 0:
            chunks.append(draft)
        return chunks

    def _record_chunks(self, batch_id: str, drafts: list[_ChunkDraft], tally: _ValidationTally) -> None:
        with self.sessions.begin() as session:
            batch = _lock_batch(session, batch_id)
            if batch is None or batch.status not in (BatchStatus.validating, BatchStatus.cancelling):
                return
            if batch.in_progress_at is not None:  # a re-delivered validate of a batch cancelled after it started
                return
            batch.total_requests = tally.lines
            batch.failed_requests = tally.invalid
            cancelled = batch.status == BatchStatus.cancelling
            if not cancelled:
                session.add_all(
                    Chunk(
                        batch_id=batch_id,
                        index=index,
                        byte_start=draft.byte_start,
                        byte_end=draft.byte_end,
                        first_line=draft.first_line,
                        num_requests=draft.num_requests,
                        rejected_lines=draft.rejected_lines,
                        status=ChunkStatus.pending,
                    )
                    for index, draft in enumerate(drafts)
                )
                batch.status = BatchStatus.in_progress if drafts else BatchStatus.finalizing
                batch.in_progress_at = utcnow()
                if not drafts:
                    batch.finalizing_at = batch.in_progress_at
            priority = batch.priority
        if cancelled or not drafts:
            self.enqueue_finalize(batch_id)
            return
        for index in range(len(drafts)):
            self.enqueue_run_chunk(batch_id, index, priority)

    def _enqueue_pending_chunks(self, batch_id: str) -> None:
        with self.sessions() as session:
            priority = session.scalar(select(Batch.priority).where(Batch.id == batch_id)) or 0
            pending = session.scalars(
                select(Chunk.index).where(Chunk.batch_id == batch_id, Chunk.status == ChunkStatus.pending)
            ).all()
        for index in pending:
            self.enqueue_run_chunk(batch_id, index, priority)

    def _fail(self, batch_id: str, code: str, message: str) -> None:
        with self.sessions.begin() as session:
            batch = _lock_batch(session, batch_id)
            if batch is None or batch.status not in (BatchStatus.validating, BatchStatus.cancelling):
                return
            batch.status = BatchStatus.failed
            batch.failed_at = utcnow()
            batch.errors = [{"code": code, "message": message, "param": None, "line": None}]
            deliveries = record_batch_event(session, batch)
        self.enqueue_webhook_deliveries(deliveries)

    # -----------------------------------------------------------------------------------------------------
    # run_chunk

    def run_chunk(self, batch_id: str, index: int) -> None:
        with self.sessions() as session:
            chunk = session.get(Chunk, (batch_id, index))
            batch = session.get(Batch, batch_id)
            if chunk is None or batch is None:
                return
            session.expunge_all()
        if chunk.status == ChunkStatus.pending:
            if batch.status == BatchStatus.in_progress:
                self._complete_chunk(batch, chunk)
            else:  # cancelling, or finalizing early because it expired: chunks not yet started never will
                # Not this chunk unconditionally: this may be a re-delivery of a chunk another thread is running
                # (its lease says so), whose finished results must still be kept.
                self._skip_unstarted_chunks(batch_id)
        self._maybe_finalize(batch_id)

    def _complete_chunk(self, batch: Batch, chunk: Chunk) -> None:
        finished = self.store.head(chunk_output_key(batch.id, chunk.index))
        if finished is not None:  # ran to the end before its worker died; only the bookkeeping is missing
            log.info("batch %s chunk %d: output already written, marking it done", batch.id, chunk.index)
            self._finish_chunk(
                batch.id,
                chunk.index,
                ChunkStatus.done,
                int(finished.metadata["completed"]),
                int(finished.metadata["failed"]),
            )
            return
        lease = self.redis.lock(
            self._lease_key(batch.id, chunk.index),
            timeout=self.settings.chunk_lease_seconds,
            blocking=False,
            thread_local=False,  # the renewer thread must see the token this thread acquired it with
        )
        if not lease.acquire():
            raise ChunkBusy(f"chunk {chunk.index} of {batch.id} is running elsewhere")
        stop_renewing = threading.Event()
        renewer = threading.Thread(
            target=_keep_renewing, args=(lease, stop_renewing, self.settings.chunk_lease_seconds / 3), daemon=True
        )
        renewer.start()
        try:
            if batch.endpoint == RAG_ENDPOINT:
                completed, failed = self.rag.run_documents(
                    batch,
                    [line for _, line in self._chunk_lines(batch, chunk)],
                    output_key=chunk_output_key(batch.id, chunk.index),
                    errors_key=chunk_errors_key(batch.id, chunk.index),
                )
            else:
                completed, failed = self._run_requests(batch, chunk)
            self._finish_chunk(batch.id, chunk.index, ChunkStatus.done, completed, failed)
            log.info("batch %s chunk %d: %d completed, %d failed", batch.id, chunk.index, completed, failed)
        finally:
            stop_renewing.set()
            renewer.join()
            try:
                lease.release()
            except LockError:  # it lapsed meanwhile; whoever took it over will find the output and skip
                pass

    def _chunk_lines(self, batch: Batch, chunk: Chunk) -> Iterator[tuple[LineNumber, bytes]]:
        """The chunk's lines that validate accepted, with their numbers."""
        data = self.store.read_range(file_key(batch.project_id, batch.input_file_id), chunk.byte_start, chunk.byte_end)
        rejected = set(chunk.rejected_lines)  # validation already wrote their error records
        for line_number, _, _, line in iter_lines([data], chunk.first_line, chunk.byte_start):
            if line_number not in rejected and line.strip():
                yield line_number, line

    def _run_requests(self, batch: Batch, chunk: Chunk) -> tuple[int, int]:
        validator = BatchLineValidator(self.engine.tokenizer, self.engine.max_model_len, batch.endpoint)  # type: ignore[arg-type]
        run_id = secrets.token_hex(4)  # keeps engine request ids unique should a lapsed lease let this chunk run twice
        submitted: list[tuple[BatchRequest, RequestHandle]] = []
        embedding_requests: list[EmbeddingRequest] = []
        records: list[BatchOutputLine] = []
        for line_number, line in self._chunk_lines(batch, chunk):
            checked = validator.validate(line)
            if isinstance(checked, LineError):  # validate accepted this line; only a changed model could refuse it now
                records.append(error_record(checked))
            elif isinstance(checked, EmbeddingRequest):
                embedding_requests.append(checked)
            else:
                handle = self.engine.loop.submit(
                    checked.prompt_token_ids,
                    checked.sampling_params,
                    request_id=f"{batch.id}/{chunk.index}/{line_number}/{run_id}",
                    priority=batch.priority,
                )
                submitted.append((checked, handle))

        if embedding_requests:
            # One call for the whole chunk, so the embedder packs across lines. It cannot be aborted midway: a stopped
            # batch's embeddings chunk that has started runs to its end and its results are reported.
            records += embedding_records(embedding_requests, self.embedder)
        records += self._generation_records(batch.id, submitted)
        output_lines = [record.model_dump_json().encode() + b"\n" for record in records if record.error is None]
        error_lines = [record.model_dump_json().encode() + b"\n" for record in records if record.error is not None]
        completed, failed = len(output_lines), len(error_lines)
        self.store.put_bytes(chunk_errors_key(batch.id, chunk.index), b"".join(error_lines))
        self.store.put_bytes(
            chunk_output_key(batch.id, chunk.index),
            b"".join(output_lines),
            metadata={"completed": str(completed), "failed": str(failed)},
        )
        return completed, failed

    def _generation_records(
        self, batch_id: str, submitted: list[tuple[BatchRequest, RequestHandle]]
    ) -> list[BatchOutputLine]:
        """The records of the requests submitted to the engine, once all have finished or the batch was stopped."""
        stopped = self._await_or_abort(batch_id, [handle for _, handle in submitted])
        records: list[BatchOutputLine] = []
        for request, handle in submitted:
            try:
                result = handle.result()
            except ValueError as refused:  # the engine refused the request itself; only this line fails
                records.append(error_record(LineError(request.custom_id, "invalid_parameter", str(refused))))
                continue
            if stopped is not None and any(sample.finish_reason == "abort" for sample in result.outputs):
                if stopped == StopReason.expired:  # when cancelled, as OpenAI: only what finished is reported
                    records.append(_expired_record(request.custom_id))
                continue
            records.append(
                response_record(request, result, model=self.engine.model_name, tokenizer=self.engine.tokenizer)
            )
        return records

    def _await_or_abort(self, batch_id: str, handles: list[RequestHandle]) -> StopReason | None:
        """Wait for every request; if the batch is stopped meanwhile, abort the unfinished ones in the engine
        and return why. The aborted requests' handles then hold outputs with finish_reason 'abort'."""
        unfinished = {handle.future: handle for handle in handles}
        while unfinished:
            _, still_running = wait(unfinished, timeout=STOP_POLL_SECONDS)
            unfinished = {future: unfinished[future] for future in still_running}
            if unfinished and (reason := self.stop_flags.reason(batch_id)) is not None:
                for handle in unfinished.values():
                    self.engine.loop.abort(handle.request_id)
                wait(unfinished)
                log.info("batch %s %s: aborted %d requests in the engine", batch_id, reason.value, len(unfinished))
                return reason
        return None

    def _finish_chunk(self, batch_id: str, index: int, status: ChunkStatus, completed: int, failed: int) -> None:
        with self.sessions.begin() as session:
            claimed = session.execute(
                update(Chunk)
                .where(Chunk.batch_id == batch_id, Chunk.index == index, Chunk.status == ChunkStatus.pending)
                .values(status=status, completed_requests=completed, failed_requests=failed, finished_at=utcnow())
                .returning(Chunk.index)
            ).first()
            if claimed is not None and (completed or failed):
                session.execute(
                    update(Batch)
                    .where(Batch.id == batch_id)
                    .values(
                        completed_requests=Batch.completed_requests + completed,
                        failed_requests=Batch.failed_requests + failed,
                    )
                )

    def _maybe_finalize(self, batch_id: str) -> None:
        with self.sessions.begin() as session:
            batch = _lock_batch(session, batch_id)
            if batch is None or batch.status not in (
                BatchStatus.in_progress,
                BatchStatus.finalizing,
                BatchStatus.cancelling,
            ):
                return
            if batch.status != BatchStatus.finalizing and has_pending_chunks(session, batch_id):
                return
            if batch.status == BatchStatus.in_progress:
                batch.status = BatchStatus.finalizing
                batch.finalizing_at = utcnow()
        self.enqueue_finalize(batch_id)

    # -----------------------------------------------------------------------------------------------------
    # finalize

    def finalize(self, batch_id: str) -> None:
        with self.sessions() as session:
            batch = session.get(Batch, batch_id)
            if batch is None or batch.status not in (BatchStatus.finalizing, BatchStatus.cancelling):
                return
            stop_reason = _stop_reason(batch)
        if stop_reason is not None:
            # Raised again here: the first flag (set by the cancel or the expiry sweep) may be lost with Redis.
            self.stop_flags.raise_flag(batch_id, stop_reason)
            self._skip_unstarted_chunks(batch_id)

        with self.sessions() as session:
            batch = session.get(Batch, batch_id)
            if batch is None or has_pending_chunks(session, batch_id):
                return  # chunks still running abort within a second; the last one to finish calls finalize again
            done = session.scalars(
                select(Chunk.index)
                .where(Chunk.batch_id == batch_id, Chunk.status == ChunkStatus.done)
                .order_by(Chunk.index)
            ).all()
            never_started = (
                session.scalars(
                    select(Chunk)
                    .where(Chunk.batch_id == batch_id, Chunk.status == ChunkStatus.skipped)
                    .order_by(Chunk.index)
                ).all()
                if stop_reason == StopReason.expired
                else []
            )
            session.expunge_all()
            project_id = batch.project_id
            completed, failed = batch.completed_requests, batch.failed_requests

        expired_unstarted = sum(chunk.num_requests for chunk in never_started)
        if expired_unstarted:
            self._write_expired_requests(batch, never_started)
        failed += expired_unstarted
        files: list[File] = []
        output_file_id = error_file_id = None
        outputs = [chunk_output_key(batch_id, index) for index in done]
        if completed:
            output_file_id = derived_file_id(batch_id, "output")
            if batch.endpoint == RAG_ENDPOINT:
                files.append(self.rag.merge_outputs(project_id, output_file_id, f"{batch_id}.parquet", outputs))
            else:
                files.append(self._compose_file(project_id, output_file_id, f"{batch_id}_output.jsonl", outputs))
        if failed:
            error_file_id = derived_file_id(batch_id, "error")
            sources = [validation_errors_key(batch_id)] + [chunk_errors_key(batch_id, index) for index in done]
            sources.append(expired_requests_key(batch_id))
            files.append(self._compose_file(project_id, error_file_id, f"{batch_id}_error.jsonl", sources))
        if batch.endpoint == RAG_ENDPOINT:
            files.append(
                self.rag.write_manifest(
                    batch, stop_reason, outputs, failed=failed, output_file_id=output_file_id, error_file_id=error_file_id
                )
            )

        with self.sessions.begin() as session:
            batch = _lock_batch(session, batch_id)
            if batch is None or batch.status not in (BatchStatus.finalizing, BatchStatus.cancelling):
                return
            for file in files:
                if session.get(File, file.id) is None:
                    session.add(file)
            now = utcnow()
            if batch.status == BatchStatus.cancelling:
                batch.status, batch.cancelled_at = BatchStatus.cancelled, now
            elif batch.expired_at is not None:  # the sweep set it when it stopped the batch
                batch.status = BatchStatus.expired
                batch.failed_requests += expired_unstarted
            else:
                batch.status, batch.completed_at = BatchStatus.completed, now
            batch.output_file_id, batch.error_file_id = output_file_id, error_file_id
            deliveries = record_batch_event(session, batch)
        self.enqueue_webhook_deliveries(deliveries)

    def _skip_unstarted_chunks(self, batch_id: str) -> None:
        """Mark the stopping batch's queued chunks skipped now, rather than when their tasks come up (maybe behind
        hours of other work). A chunk holding its lease is running: it aborts on the stop flag and finishes itself.
        One whose task takes its lease just after this finds its results discarded, which is what skipped means."""
        with self.sessions.begin() as session:
            pending = session.scalars(
                select(Chunk.index).where(Chunk.batch_id == batch_id, Chunk.status == ChunkStatus.pending)
            ).all()
            leases = self.redis.pipeline(transaction=False)
            for index in pending:
                leases.exists(self._lease_key(batch_id, index))
            unstarted = [index for index, leased in zip(pending, leases.execute()) if not leased]
            if unstarted:
                session.execute(
                    update(Chunk)
                    .where(
                        Chunk.batch_id == batch_id,
                        Chunk.index.in_(unstarted),
                        Chunk.status == ChunkStatus.pending,
                    )
                    .values(status=ChunkStatus.skipped, finished_at=utcnow())
                )

    def _write_expired_requests(self, batch: Batch, chunks: list[Chunk]) -> None:
        """A `batch_expired` error line for each request of the chunks that never ran, as OpenAI reports them."""
        lines = self._input_lines(batch.endpoint, batch.project_id)
        with self.store.upload_stream(expired_requests_key(batch.id)) as records:
            for chunk in chunks:
                for _, line in self._chunk_lines(batch, chunk):
                    records.write(lines.expired_record(line))

    def _lease_key(self, batch_id: str, index: int) -> str:
        return f"{self.settings.redis_prefix}chunk-lease:{batch_id}:{index}"

    def _compose_file(self, project_id: str, file_id: str, filename: str, sources: list[str]) -> File:
        existing = [key for key in sources if self.store.exists(key)]
        key = file_key(project_id, file_id)
        size = self.store.compose(key, existing)
        return File(
            id=file_id,
            project_id=project_id,
            filename=filename,
            purpose=FilePurpose.batch_output,
            bytes=size,
            object_key=key,
        )


def _keep_renewing(lease: Lock, stop: threading.Event, every_seconds: float) -> None:
    while not stop.wait(every_seconds):
        try:
            lease.reacquire()
        except LockError:
            return
        except RedisError as unreachable:  # Redis restarting: the lease may survive it, so keep trying
            log.warning("cannot renew %s: %s", lease.name, unreachable)


def _stop_reason(batch: Batch) -> StopReason | None:
    """Why a batch on its way to finalize is stopping early, if it is."""
    if batch.status == BatchStatus.cancelling:
        return StopReason.cancelled
    if batch.expired_at is not None:
        return StopReason.expired
    return None


def _expired_record(custom_id: str | None) -> BatchOutputLine:
    return error_record(
        LineError(custom_id, "batch_expired", "the batch expired before this request was completed")
    )


def _jsonl(record: BatchOutputLine) -> bytes:
    return record.model_dump_json().encode() + b"\n"


def _lock_batch(session: Session, batch_id: str) -> Batch | None:
    """The batch row, locked until the transaction ends: status changes of one batch happen one at a time."""
    return session.scalar(select(Batch).where(Batch.id == batch_id).with_for_update())
