"""The exactly-once bookkeeping (`jobs.run.ledger`) against real PostgreSQL and S3: every step run twice moves the
counts and statuses once."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import select

from jobs.db import SessionFactory, make_engine, make_session_factory
from jobs.models import Batch, BatchStatus, Chunk, ChunkStatus, File, FilePurpose, Project, WebhookEvent, utcnow
from jobs.run import ledger
from jobs.run.kinds import ChunkResult, TokenUsage
from jobs.run.split import ChunkDraft, ValidationTally
from jobs.storage import ObjectStore


@pytest.fixture(scope="module")
def sessions(database_url: str) -> Iterator[SessionFactory]:
    engine = make_engine(database_url)
    yield make_session_factory(engine)
    engine.dispose()


def new_batch(sessions: SessionFactory, status: BatchStatus = BatchStatus.validating) -> str:
    with sessions.begin() as session:
        project = Project(name=f"ledger-{secrets.token_hex(4)}")
        session.add(project)
        session.flush()
        batch = Batch(
            project_id=project.id,
            input_file_id="file-x",
            endpoint="/v1/completions",
            completion_window="24h",
            expires_at=utcnow() + timedelta(hours=24),
            priority=-3,
        )
        session.add(batch)
        session.flush()
        batch.status = status
        return batch.id


def batch_row(sessions: SessionFactory, batch_id: str) -> Batch:
    with sessions() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        session.expunge(batch)
        return batch


DRAFTS = [ChunkDraft(0, 1, 10, 2, []), ChunkDraft(10, 3, 25, 2, [4]), ChunkDraft(25, 6, 30, 1, [])]
TALLY = ValidationTally(lines=6, valid=5, invalid=1)


def started_batch(sessions: SessionFactory) -> str:
    batch_id = new_batch(sessions)
    assert ledger.record_chunks(sessions, batch_id, DRAFTS, TALLY) is not None
    return batch_id


def test_validate_records_the_chunks_once(sessions: SessionFactory) -> None:
    batch_id = new_batch(sessions)
    recorded = ledger.record_chunks(sessions, batch_id, DRAFTS, TALLY)
    assert recorded == ledger.RecordedChunks([0, 1, 2], priority=-3)
    batch = batch_row(sessions, batch_id)
    assert batch.status == BatchStatus.in_progress and (batch.total_requests, batch.failed_requests) == (6, 1)
    assert ledger.record_chunks(sessions, batch_id, DRAFTS, TALLY) is None  # a re-delivered validate adds nothing
    assert ledger.pending_chunks(sessions, batch_id) == ledger.RecordedChunks([0, 1, 2], priority=-3)
    with sessions() as session:
        chunks = session.scalars(select(Chunk).where(Chunk.batch_id == batch_id).order_by(Chunk.index)).all()
        assert [(c.byte_start, c.byte_end, c.rejected_lines) for c in chunks] == [(0, 10, []), (10, 25, [4]), (25, 30, [])]


def test_a_batch_cancelled_during_validate_gets_no_chunks(sessions: SessionFactory) -> None:
    batch_id = new_batch(sessions, BatchStatus.cancelling)
    assert ledger.record_chunks(sessions, batch_id, DRAFTS, TALLY) == ledger.RecordedChunks([], priority=-3)
    assert ledger.pending_chunks(sessions, batch_id).chunk_indexes == []


def test_a_chunk_counts_once_however_often_it_is_finished(sessions: SessionFactory) -> None:
    batch_id = started_batch(sessions)
    for _ in range(3):
        ledger.finish_chunk(sessions, batch_id, 1, ChunkStatus.done, completed=1, failed=1, usage=TokenUsage(5, 3, 2))
    batch = batch_row(sessions, batch_id)
    assert (batch.completed_requests, batch.failed_requests) == (1, 2)  # 1 from validation, 1 from the chunk
    assert (batch.input_tokens, batch.output_tokens, batch.cached_tokens) == (5, 3, 2)
    assert not ledger.finish_if_last(sessions, batch_id)  # chunks 0 and 2 are pending
    ledger.finish_chunk(sessions, batch_id, 0, ChunkStatus.done, completed=2, failed=0)
    ledger.finish_chunk(sessions, batch_id, 2, ChunkStatus.done, completed=1, failed=0)
    assert ledger.finish_if_last(sessions, batch_id)
    assert batch_row(sessions, batch_id).status == BatchStatus.finalizing
    assert ledger.finish_if_last(sessions, batch_id)  # asked again (a re-delivered chunk): finalize runs again, harmless


def test_a_chunk_is_complete_once_its_output_object_exists(object_store: ObjectStore) -> None:
    batch_id = f"batch_{secrets.token_hex(6)}"
    assert ledger.written_chunk_counts(object_store, batch_id, 0) is None
    ledger.write_chunk_result(
        object_store, batch_id, 0, ChunkResult(
            b"out\n", b"err\n", completed=3, failed=1, metadata={"stats": "{}"}, usage=TokenUsage(30, 7, 16)
        )
    )
    assert ledger.written_chunk_counts(object_store, batch_id, 0) == (3, 1, TokenUsage(30, 7, 16))


def test_a_stopping_batch_skips_only_the_chunks_nobody_runs(sessions: SessionFactory) -> None:
    batch_id = started_batch(sessions)
    ledger.skip_unstarted_chunks(sessions, batch_id, lambda indexes: [index == 1 for index in indexes])
    with sessions() as session:
        statuses = session.scalars(select(Chunk.status).where(Chunk.batch_id == batch_id).order_by(Chunk.index)).all()
    assert statuses == [ChunkStatus.skipped, ChunkStatus.pending, ChunkStatus.skipped]


def test_a_batch_is_settled_once(sessions: SessionFactory) -> None:
    batch_id = new_batch(sessions, BatchStatus.finalizing)
    project_id = batch_row(sessions, batch_id).project_id
    output = File(
        id=f"file-{secrets.token_hex(6)}",
        project_id=project_id,
        filename="out.jsonl",
        purpose=FilePurpose.batch_output,
        bytes=4,
        object_key="k",
    )
    ledger.settle_batch(sessions, batch_id, [output], output_file_id=output.id, error_file_id=None, expired_unstarted=0)
    settled = batch_row(sessions, batch_id)
    assert settled.status == BatchStatus.completed and settled.output_file_id == output.id
    again = ledger.settle_batch(
        sessions, batch_id, [output], output_file_id="file-other", error_file_id=None, expired_unstarted=5
    )
    assert again == [] and batch_row(sessions, batch_id).output_file_id == output.id
    with sessions() as session:
        assert len(session.scalars(select(WebhookEvent).where(WebhookEvent.batch_id == batch_id)).all()) == 1


def test_an_expired_batch_fails_the_requests_that_never_ran(sessions: SessionFactory) -> None:
    batch_id = new_batch(sessions, BatchStatus.finalizing)
    with sessions.begin() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        batch.expired_at = utcnow()
    ledger.settle_batch(sessions, batch_id, [], output_file_id=None, error_file_id=None, expired_unstarted=4)
    settled = batch_row(sessions, batch_id)
    assert settled.status == BatchStatus.expired and settled.failed_requests == 4


def test_a_batch_validate_cannot_read_fails_once(sessions: SessionFactory) -> None:
    batch_id = new_batch(sessions)
    ledger.fail_batch(sessions, batch_id, "empty_file", "the input file holds no requests")
    assert ledger.fail_batch(sessions, batch_id, "empty_file", "again") == []
    failed = batch_row(sessions, batch_id)
    assert failed.status == BatchStatus.failed and failed.errors is not None
    assert failed.errors[0]["message"] == "the input file holds no requests"
