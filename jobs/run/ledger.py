"""Exactly-once: how a batch's results and counts survive crashes and re-deliveries without loss or twins.

Every step of a batch (validate, run_chunk, finalize) may run twice: tasks are acknowledged late, so a worker
killed mid-task has its task delivered again, and Redis also re-delivers the tasks of workers that are merely slow.
The rules that make a second run harmless all live here:

- validate records the chunks and the batch's totals in one transaction, and only while the batch has not
  started (`in_progress_at` unset); a second validate of a started batch re-enqueues its pending chunks.
- A chunk writes its errors object, then its output object (`write_chunk_result`): the output object's existence
  means the chunk is complete. A re-delivered chunk whose output exists is only marked done; one without is redone
  from scratch (its lease, `jobs.run.lease`, keeps a second worker off it while the first one runs).
- Marking a chunk done and adding its counts and token usage to the batch is one conditional update (`finish_chunk`: `UPDATE chunks
  ... WHERE status = 'pending'`, and the batch's counts only if that claimed the row), so counts move exactly once.
- Status changes of one batch happen under its row lock (`lock_batch`), one at a time; the chunk that finishes
  last moves the batch to `finalizing` (`finish_if_last`).
- Finalize's files get ids derived from the batch id (`jobs.files.derived_file_id`), so a second finalize
  overwrites its objects instead of adding twins; the final status and the webhook event are set only if the
  batch is still `finalizing` or `cancelling` (`settle_batch`), and the event is unique per batch and type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from jobs.batches import has_pending_chunks
from jobs.db import SessionFactory
from jobs.models import Batch, BatchStatus, Chunk, ChunkStatus, File, utcnow
from jobs.object_keys import chunk_errors_key, chunk_output_key
from jobs.run.kinds import ChunkResult, TokenUsage
from jobs.run.split import ChunkDraft, ValidationTally
from jobs.storage import ObjectStore
from jobs.webhooks.events import record_batch_event

STARTABLE = (BatchStatus.validating, BatchStatus.cancelling)  # the statuses validate may still act on
SETTLEABLE = (BatchStatus.finalizing, BatchStatus.cancelling)  # the statuses finalize may still end


@dataclass(frozen=True)
class RecordedChunks:
    """What validate's transaction decided: run these chunks, or go straight to finalize."""

    chunk_indexes: list[int]  # empty: nothing to run (cancelled meanwhile, or no accepted line)
    priority: int
    model: str | None = None  # the batch's model, whose workers' queue takes its chunks


def lock_batch(session: Session, batch_id: str) -> Batch | None:
    """The batch row, locked until the transaction ends: status changes of one batch happen one at a time."""
    return session.scalar(select(Batch).where(Batch.id == batch_id).with_for_update())


def record_chunks(
    sessions: SessionFactory, batch_id: str, drafts: list[ChunkDraft], tally: ValidationTally
) -> RecordedChunks | None:
    """The chunks, the batch's totals and `in_progress` in one transaction; None if the batch had already moved on
    (a re-delivered validate)."""
    with sessions.begin() as session:
        batch = lock_batch(session, batch_id)
        if batch is None or batch.status not in STARTABLE:
            return None
        if batch.in_progress_at is not None:  # a re-delivered validate of a batch cancelled after it started
            return None
        batch.total_requests = tally.lines
        batch.failed_requests = tally.invalid
        if batch.status == BatchStatus.cancelling:
            return RecordedChunks([], batch.priority, batch.model)
        session.add_all(
            Chunk(
                batch_id=batch_id,
                index=index,
                byte_start=draft.byte_start,
                byte_end=draft.byte_end,
                first_line=draft.first_line,
                num_requests=draft.num_requests,
                rejected_lines=draft.rejected_lines,
                request_ids=draft.request_ids,
                status=ChunkStatus.pending,
            )
            for index, draft in enumerate(drafts)
        )
        batch.status = BatchStatus.in_progress if drafts else BatchStatus.finalizing
        batch.in_progress_at = utcnow()
        if not drafts:
            batch.finalizing_at = batch.in_progress_at
        return RecordedChunks(list(range(len(drafts))), batch.priority, batch.model)


def pending_chunks(sessions: SessionFactory, batch_id: str) -> RecordedChunks:
    """The chunks not yet done, to enqueue again."""
    with sessions() as session:
        priority, model = session.execute(select(Batch.priority, Batch.model).where(Batch.id == batch_id)).one()
        pending = session.scalars(
            select(Chunk.index).where(Chunk.batch_id == batch_id, Chunk.status == ChunkStatus.pending)
        ).all()
    return RecordedChunks(list(pending), priority, model)


def set_batch_model(sessions: SessionFactory, batch_id: str, model: str) -> None:
    """The batch's model, decided once (by the first validate to read its first line)."""
    with sessions.begin() as session:
        session.execute(update(Batch).where(Batch.id == batch_id, Batch.model.is_(None)).values(model=model))


def fail_batch(sessions: SessionFactory, batch_id: str, code: str, message: str) -> list[str]:
    """Fail a batch validate could not read (or gave up on); returns the webhook deliveries to enqueue."""
    with sessions.begin() as session:
        batch = lock_batch(session, batch_id)
        if batch is None or batch.status not in STARTABLE:
            return []
        return fail_locked(session, batch, code, message)


def fail_locked(session: Session, batch: Batch, code: str, message: str) -> list[str]:
    """`failed` with one batch-level error, for a batch whose row lock `session` holds; returns the webhook
    deliveries to enqueue once it commits. Its counts and any results its chunks wrote stay as they are."""
    batch.status = BatchStatus.failed
    batch.failed_at = utcnow()
    batch.errors = [{"code": code, "message": message, "param": None, "line": None}]
    return record_batch_event(session, batch)


def write_chunk_result(store: ObjectStore, batch_id: str, index: int, result: ChunkResult) -> None:
    """The errors object first, then the output object, whose existence says the chunk is complete; its metadata
    holds the counts, for a re-delivery that finds it to mark the chunk done with."""
    store.put_bytes(chunk_errors_key(batch_id, index), result.errors)
    usage = result.usage
    store.put_bytes(
        chunk_output_key(batch_id, index),
        result.output,
        metadata={
            **result.metadata,
            "completed": str(result.completed),
            "failed": str(result.failed),
            "input_tokens": str(usage.input_tokens),
            "output_tokens": str(usage.output_tokens),
            "cached_tokens": str(usage.cached_tokens),
        },
    )


def written_chunk_counts(store: ObjectStore, batch_id: str, index: int) -> tuple[int, int, TokenUsage] | None:
    """(completed, failed, usage) of a chunk whose output object exists; None if it has not been written."""
    finished = store.head(chunk_output_key(batch_id, index))
    if finished is None:
        return None
    meta = finished.metadata
    usage = TokenUsage(*(int(meta.get(name, 0)) for name in ("input_tokens", "output_tokens", "cached_tokens")))
    return int(meta["completed"]), int(meta["failed"]), usage


def finish_chunk(
    sessions: SessionFactory,
    batch_id: str,
    index: int,
    status: ChunkStatus,
    completed: int,
    failed: int,
    usage: TokenUsage = TokenUsage(),
) -> None:
    """Mark a pending chunk done (or skipped, or failed) and, only if this call did, add its counts and usage to the batch."""
    with sessions.begin() as session:
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
                    input_tokens=Batch.input_tokens + usage.input_tokens,
                    output_tokens=Batch.output_tokens + usage.output_tokens,
                    cached_tokens=Batch.cached_tokens + usage.cached_tokens,
                )
            )


def fail_chunk(
    store: ObjectStore, sessions: SessionFactory, batch_id: str, index: int, error_records: Sequence[bytes]
) -> None:
    """A pending chunk that will not run: its requests' error records written, the chunk `failed` and its
    requests counted as failed. Finalize puts the records in the error file; the chunk has no output object."""
    store.put_bytes(chunk_errors_key(batch_id, index), b"".join(error_records))
    finish_chunk(sessions, batch_id, index, ChunkStatus.failed, 0, len(error_records))


def finish_if_last(sessions: SessionFactory, batch_id: str) -> bool:
    """Whether finalize should run now: no chunk is pending (the batch then moves to `finalizing`), or the batch
    is already finalizing or cancelling."""
    with sessions.begin() as session:
        batch = lock_batch(session, batch_id)
        if batch is None or batch.status not in (BatchStatus.in_progress, *SETTLEABLE):
            return False
        if batch.status != BatchStatus.finalizing and has_pending_chunks(session, batch_id):
            return False
        if batch.status == BatchStatus.in_progress:
            batch.status = BatchStatus.finalizing
            batch.finalizing_at = utcnow()
    return True


def skip_unstarted_chunks(
    sessions: SessionFactory, batch_id: str, leased: Callable[[Sequence[int]], list[bool]]
) -> None:
    """Mark the stopping batch's queued chunks skipped now, rather than when their tasks come up (maybe behind
    hours of other work). A chunk holding its lease is running: it aborts on the stop flag and finishes itself.
    One whose task takes its lease just after this finds its results discarded, which is what skipped means."""
    with sessions.begin() as session:
        pending = session.scalars(
            select(Chunk.index).where(Chunk.batch_id == batch_id, Chunk.status == ChunkStatus.pending)
        ).all()
        unstarted = [index for index, is_leased in zip(pending, leased(pending)) if not is_leased]
        if unstarted:
            session.execute(
                update(Chunk)
                .where(Chunk.batch_id == batch_id, Chunk.index.in_(unstarted), Chunk.status == ChunkStatus.pending)
                .values(status=ChunkStatus.skipped, finished_at=utcnow())
            )


def settle_batch(
    sessions: SessionFactory,
    batch_id: str,
    files: list[File],
    *,
    output_file_id: str | None,
    error_file_id: str | None,
    expired_unstarted: int,
) -> list[str]:
    """The batch's files and final status, if nobody settled it first; returns the webhook deliveries to enqueue."""
    with sessions.begin() as session:
        batch = lock_batch(session, batch_id)
        if batch is None or batch.status not in SETTLEABLE:
            return []
        now = utcnow()
        for file in files:
            if file.id in (output_file_id, error_file_id) and batch.output_expires_after_seconds is not None:
                file.expires_at = now + timedelta(seconds=batch.output_expires_after_seconds)  # created now
            if session.get(File, file.id) is None:
                session.add(file)
        if batch.status == BatchStatus.cancelling:
            batch.status, batch.cancelled_at = BatchStatus.cancelled, now
        elif batch.expired_at is not None:  # the sweep set it when it stopped the batch
            batch.status = BatchStatus.expired
            batch.failed_requests += expired_unstarted
        else:
            batch.status, batch.completed_at = BatchStatus.completed, now
        batch.output_file_id, batch.error_file_id = output_file_id, error_file_id
        return record_batch_event(session, batch)
