"""A batch's life after it is created: validate → run_chunk × N → finalize, for every kind of job.

Celery only delivers these steps (`jobs.tasks`); the steps themselves live here, free of Celery, as a short
orchestration over the pieces that each own one concept:

- `jobs.run.split`: validate's one pass over the input, rejected lines to error records, the rest into chunks;
- `jobs.run.lease`: the Redis lease that keeps two workers off one chunk;
- `jobs.run.ledger`: the exactly-once bookkeeping (what makes every step safe to run twice: read it first);
- `jobs.run.finalize`: the done chunks' objects composed into the job's files;
- `jobs.run.kinds`: what differs between kinds of job (OpenAI generation lines, embeddings lines, RAG documents),
  looked up by the batch's endpoint, so nothing here asks which kind it runs.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator, Mapping

from redis import Redis
from sqlalchemy import select

from jobs.batches import has_pending_chunks
from jobs.db import SessionFactory
from jobs.models import Batch, BatchStatus, Chunk, ChunkStatus
from jobs.object_keys import file_key, validation_errors_key
from jobs.run import ledger
from jobs.run.finalize import compose_final_files, stop_reason_of
from jobs.run.kinds import JobKind
from jobs.run.lease import ChunkBusy, ChunkLeases, LeaseLost
from jobs.run.ledger import RecordedChunks
from jobs.run.split import ChunkDraft, LineNumber, RequestId, ValidationTally, accepted_lines, split_into_chunks
from jobs.formats.registry import MODEL_KINDS
from jobs.served_models import WorkerModels
from jobs.settings import Settings
from jobs.stop_flags import StopFlags, StopReason
from jobs.storage import ObjectNotFound, ObjectRefused, ObjectStore

log = logging.getLogger(__name__)

# How much of the input validate reads to learn the batch's model from its first line: a line longer than this
# leaves the batch with this worker's model.
FIRST_LINE_BYTES = 1 << 20


class ChunkCannotRun(Exception):
    """A chunk that no retry can mend: its input is gone or the store refuses it. Its requests fail at once, each
    with this error's message (it says what happened, nothing internal), and the batch completes with the rest."""


class Pipeline:
    def __init__(
        self,
        *,
        settings: Settings,
        sessions: SessionFactory,
        store: ObjectStore,
        redis: Redis,
        kinds: Mapping[str, JobKind],  # by endpoint
        models: WorkerModels,
        enqueue_validate: Callable[[str, str | None], None],
        enqueue_run_chunk: Callable[[str, int, int, str | None], None],
        enqueue_finalize: Callable[[str], None],
        enqueue_webhook_deliveries: Callable[[list[str]], None],
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.store = store
        self.stop_flags = StopFlags(redis, settings.redis_prefix)
        self.leases = ChunkLeases(redis, settings.redis_prefix, settings.chunk_lease_seconds)
        self.kinds = kinds
        self.models = models
        self.enqueue_validate = enqueue_validate
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
            session.expunge(batch)
        if batch.status == BatchStatus.in_progress:  # a re-delivered validate: its chunks may not all have been enqueued
            self._enqueue(batch_id, ledger.pending_chunks(self.sessions, batch_id))
            return
        if batch.status not in ledger.STARTABLE:
            return
        model_kind = MODEL_KINDS.get(batch.endpoint)
        if model_kind is not None and batch.model is None:  # a batch's model is the one its first line names
            batch.model = self.models.batch_model(self._first_line_model(batch), model_kind)
            ledger.set_batch_model(self.sessions, batch_id, batch.model)
        # A job bound to a model (a batch; a RAG job reading pages, bound at creation) is validated where that model
        # runs: a batch's lines are read with its tokenizer, and its kind checks the job against that engine.
        if batch.model is not None and self.models.served_elsewhere(batch.model):
            self.enqueue_validate(batch_id, batch.model)
            return

        lines = self.kinds[batch.endpoint].input_lines(batch)
        tally = ValidationTally()
        chunks: list[ChunkDraft] = []
        try:
            with self.store.upload_stream(validation_errors_key(batch_id)) as errors:
                input_bytes = self.store.open_stream(file_key(batch.project_id, batch.input_file_id))
                chunks = split_into_chunks(input_bytes, lines, tally, errors.write, self.settings.max_line_bytes)
        except ObjectNotFound:  # the input's bytes are gone (deleted after the batch was created)
            self._fail(batch_id, "invalid_file", f"input file {batch.input_file_id} no longer exists")
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
        refusal = lines.refusal(tally)
        if refusal is not None:
            self._fail(batch_id, *refusal)
            return
        recorded = ledger.record_chunks(self.sessions, batch_id, chunks, tally)
        if recorded is not None:
            self._enqueue(batch_id, recorded)

    def give_up_validate(self, batch_id: str, attempts: int, error: BaseException) -> None:
        """Validate failed `attempts` times and is not retried again: the batch fails now, not at its expiry. The
        client gets the error's class only; the worker's log has the whole of it."""
        log.error("batch %s: validate failed %d times, failing the batch", batch_id, attempts, exc_info=error)
        self._fail(
            batch_id,
            "validation_failed",
            f"validation could not complete: {attempts} attempts failed, the last with {type(error).__name__}; "
            "no request was run, and the same batch created again may succeed",
        )

    def _enqueue(self, batch_id: str, recorded: RecordedChunks) -> None:
        if not recorded.chunk_indexes:
            self.enqueue_finalize(batch_id)
        for index in recorded.chunk_indexes:
            self.enqueue_run_chunk(batch_id, index, recorded.priority, recorded.model)

    def _first_line_model(self, batch: Batch) -> str | None:
        """The `model` the input's first line names; None if it names none or cannot be read."""
        try:
            head = self.store.read_range(file_key(batch.project_id, batch.input_file_id), 0, FIRST_LINE_BYTES)
            body = json.loads(head.split(b"\n", 1)[0]).get("body")
        except (ObjectNotFound, ValueError, AttributeError):  # the pass over the lines reports what is wrong
            return None
        model = body.get("model") if isinstance(body, dict) else None
        return model if isinstance(model, str) else None

    def _fail(self, batch_id: str, code: str, message: str) -> None:
        self.enqueue_webhook_deliveries(ledger.fail_batch(self.sessions, batch_id, code, message))

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
                try:
                    self._complete_chunk(batch, chunk)
                except LeaseLost as lost:  # stalled past its lease: the chunk is another worker's now
                    log.warning("batch %s chunk %d: results dropped, %s", batch_id, index, lost)
                    return
            else:  # cancelling, or finalizing early because it expired: chunks not yet started never will
                # Not this chunk unconditionally: this may be a re-delivery of a chunk another thread is running
                # (its lease says so), whose finished results must still be kept.
                self._skip_unstarted_chunks(batch_id)
        if ledger.finish_if_last(self.sessions, batch_id):
            self.enqueue_finalize(batch_id)

    def _finish_if_written(self, batch_id: str, index: int) -> bool:
        """Mark the chunk done if an earlier attempt wrote all its results and only the bookkeeping is missing (its
        worker died, or the bookkeeping failed); whether it did."""
        written = ledger.written_chunk_counts(self.store, batch_id, index)
        if written is None:
            return False
        log.info("batch %s chunk %d: output already written, marking it done", batch_id, index)
        ledger.finish_chunk(self.sessions, batch_id, index, ChunkStatus.done, *written)
        return True

    def _complete_chunk(self, batch: Batch, chunk: Chunk) -> None:
        if self._finish_if_written(batch.id, chunk.index):
            return
        with self.leases.hold(batch.id, chunk.index) as lease:
            lines = list(self._chunk_lines(batch, chunk))
            result = self.kinds[batch.endpoint].run_chunk(batch, chunk.index, lines)
            # Still ours (LeaseLost if not), and nobody finished the chunk while this thread was stalled: only then
            # are these results the chunk's.
            lease.renew()
            if self._finish_if_written(batch.id, chunk.index):
                return
            ledger.write_chunk_result(self.store, batch.id, chunk.index, result)
            ledger.finish_chunk(
                self.sessions, batch.id, chunk.index, ChunkStatus.done, result.completed, result.failed, result.usage
            )
            log.info(
                "batch %s chunk %d: %d completed, %d failed", batch.id, chunk.index, result.completed, result.failed
            )

    def give_up_chunk(self, batch_id: str, index: int, attempts: int, error: BaseException) -> None:
        """run_chunk failed `attempts` times and is not retried again (or failed with `ChunkCannotRun`, which no
        retry mends): each of the chunk's requests gets a `chunk_failed` error record, written from the ids validate
        recorded (never from the input, which may be what failed), and the batch goes on to finalize now, not at
        its expiry. The client gets the error's class only, or a `ChunkCannotRun`'s message; the worker's log has
        the whole of it."""
        log.error("batch %s chunk %d: failed %d times, failing its requests", batch_id, index, attempts, exc_info=error)
        with self.sessions() as session:
            chunk = session.get(Chunk, (batch_id, index))
            batch = session.get(Batch, batch_id)
            if chunk is None or batch is None or chunk.status != ChunkStatus.pending:
                return
            session.expunge_all()
        try:
            # Under the chunk's lease, as a run would be: a re-delivery of this chunk may be running it right now,
            # and its results are the ones to keep.
            with self.leases.hold(batch_id, index):
                self._fail_chunk(batch, chunk, attempts, error)
        except ChunkBusy:
            log.info("batch %s chunk %d: running elsewhere, which finishes it", batch_id, index)
            return
        if ledger.finish_if_last(self.sessions, batch_id):
            self.enqueue_finalize(batch_id)

    def _fail_chunk(self, batch: Batch, chunk: Chunk, attempts: int, error: BaseException) -> None:
        if self._finish_if_written(batch.id, chunk.index):
            return
        message = (
            f"the request was not run: {error}"
            if isinstance(error, ChunkCannotRun)
            else f"the request's chunk of the batch failed {attempts} times, the last with {type(error).__name__}, "
            "so the request was not answered; the same request in a new batch may succeed"
        )
        input_lines = self.kinds[batch.endpoint].input_lines(batch)
        records = [
            input_lines.unrun_record(request_id, "chunk_failed", message)
            for request_id in self._request_ids(batch, chunk)
        ]
        ledger.fail_chunk(self.store, self.sessions, batch.id, chunk.index, records)

    def _chunk_lines(self, batch: Batch, chunk: Chunk) -> Iterator[tuple[LineNumber, bytes]]:
        """The chunk's lines that validate accepted, with their numbers; ChunkCannotRun if the input is gone."""
        try:
            data = self.store.read_range(
                file_key(batch.project_id, batch.input_file_id), chunk.byte_start, chunk.byte_end
            )
        except ObjectNotFound:
            raise ChunkCannotRun(f"the batch's input file {batch.input_file_id} no longer exists") from None
        except ObjectRefused as refused:
            raise ChunkCannotRun(f"the batch's input file {batch.input_file_id} cannot be read: {refused}") from None
        return accepted_lines(data, chunk.first_line, chunk.byte_start, chunk.rejected_lines)

    def _request_ids(self, batch: Batch, chunk: Chunk) -> list[RequestId]:
        """The ids of the chunk's accepted lines, as validate recorded them."""
        if chunk.request_ids is not None:
            return chunk.request_ids
        # A chunk recorded before its ids were (migration 0007): its lines checked again, as validate did.
        input_lines = self.kinds[batch.endpoint].input_lines(batch)
        checked = (input_lines.check(number, line) for number, line in self._chunk_lines(batch, chunk))
        return [request_id for request_id in checked if isinstance(request_id, str)]

    def _skip_unstarted_chunks(self, batch_id: str) -> None:
        ledger.skip_unstarted_chunks(self.sessions, batch_id, functools.partial(self.leases.held, batch_id))

    # -----------------------------------------------------------------------------------------------------
    # finalize

    def finalize(self, batch_id: str) -> None:
        with self.sessions() as session:
            batch = session.get(Batch, batch_id)
            if batch is None or batch.status not in ledger.SETTLEABLE:
                return
            stop_reason = stop_reason_of(batch)
        if stop_reason is not None:
            # Raised again here: the first flag (set by the cancel or the expiry sweep) may be lost with Redis.
            self.stop_flags.raise_flag(batch_id, stop_reason)
            self._skip_unstarted_chunks(batch_id)

        with self.sessions() as session:
            batch = session.get(Batch, batch_id)
            if batch is None or has_pending_chunks(session, batch_id):
                return  # chunks still running abort within a second; the last one to finish calls finalize again
            finished = session.execute(
                select(Chunk.index, Chunk.status)
                .where(Chunk.batch_id == batch_id, Chunk.status.in_((ChunkStatus.done, ChunkStatus.failed)))
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

        final = compose_final_files(
            self.store,
            self.kinds[batch.endpoint],
            batch,
            [index for index, status in finished if status == ChunkStatus.done],
            [index for index, status in finished if status == ChunkStatus.failed],
            list(never_started),
            stop_reason,
            self._request_ids,
        )
        deliveries = ledger.settle_batch(
            self.sessions,
            batch_id,
            final.files,
            output_file_id=final.output_file_id,
            error_file_id=final.error_file_id,
            expired_unstarted=final.expired_unstarted,
        )
        self.enqueue_webhook_deliveries(deliveries)
