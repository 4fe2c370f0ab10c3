"""Anthropic's face of the batch store (`jobs.message_batches`) against PostgreSQL and S3: creation writes the
requests as `/v1/messages` lines, listing pages newest first both ways, and a batch's counts and results follow
its lifecycle (the end-to-end run with the SDK: tests/api/test_message_batches.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import update

from jobs.batch_limits import MessageBatchLimits
from jobs.db import SessionFactory, make_engine, make_session_factory
from jobs.models import Batch, BatchStatus, Project, new_id, utcnow
from jobs.message_batches import (
    create_message_batch,
    list_message_batches,
    processing_status,
    request_counts,
    result_lines,
)
from jobs.object_keys import file_key
from jobs.storage import ObjectStore

LIMITS = MessageBatchLimits(max_requests=100, max_bytes=100_000)


@pytest.fixture
def sessions(database_url: str) -> Iterator[SessionFactory]:
    engine = make_engine(database_url, pool_size=2)
    yield make_session_factory(engine)
    engine.dispose()


def new_project(sessions: SessionFactory) -> str:
    with sessions.begin() as session:
        project = Project(id=new_id("proj_"), name=new_id("message-batches-"))
        session.add(project)
    return project.id


def create(sessions: SessionFactory, store: ObjectStore, project_id: str, custom_ids: list[str]) -> Batch:
    requests = [{"custom_id": custom_id, "params": {"model": "m", "max_tokens": 1}} for custom_id in custom_ids]
    with sessions.begin() as session:
        batch = create_message_batch(session, store, project_id, requests, LIMITS, None)
        session.expunge(batch)
    return batch


def test_creation_writes_the_requests_as_message_lines(sessions: SessionFactory, object_store: ObjectStore) -> None:
    project_id = new_project(sessions)
    batch = create(sessions, object_store, project_id, ["a", "b"])
    assert batch.id.startswith("msgbatch_") and batch.endpoint == "/v1/messages" and batch.total_requests == 2
    lines = object_store.read_bytes(file_key(project_id, batch.input_file_id)).decode().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"custom_id": custom_id, "method": "POST", "url": "/v1/messages", "body": {"model": "m", "max_tokens": 1}}
        for custom_id in ("a", "b")
    ]
    assert processing_status(batch.status) == "in_progress"
    assert request_counts(batch).processing == 2


def test_listing_pages_newest_first_after_and_before_an_id(sessions: SessionFactory, object_store: ObjectStore) -> None:
    project_id = new_project(sessions)
    ids = [create(sessions, object_store, project_id, ["x"]).id for _ in range(4)]
    with sessions.begin() as session:  # distinct creation times, oldest first
        for age, batch_id in enumerate(reversed(ids)):
            session.execute(update(Batch).where(Batch.id == batch_id).values(created_at=utcnow() - timedelta(minutes=age)))
    newest_first = ids[::-1]
    with sessions() as session:
        first = list_message_batches(session, project_id, before_id=None, after_id=None, limit=2)
        assert [row.id for row in first.rows] == newest_first[:2] and first.has_more
        older = list_message_batches(session, project_id, before_id=None, after_id=newest_first[1], limit=2)
        assert [row.id for row in older.rows] == newest_first[2:] and not older.has_more
        newer = list_message_batches(session, project_id, before_id=newest_first[3], after_id=None, limit=2)
        assert [row.id for row in newer.rows] == newest_first[1:3] and newer.has_more
        assert list_message_batches(session, new_project(sessions), before_id=None, after_id=None, limit=5).rows == []


def test_a_cancelled_batch_reports_what_never_ran_as_canceled(sessions: SessionFactory, object_store: ObjectStore) -> None:
    project_id = new_project(sessions)
    batch = create(sessions, object_store, project_id, ["done", "failed", "never"])
    output_id, error_id = new_id("file-"), new_id("file-")
    answer = {"id": "r1", "custom_id": "done", "response": {"status_code": 200, "request_id": "q", "body": {"id": "msg_1"}}, "error": None}
    error = {"id": "r2", "custom_id": "failed", "response": None, "error": {"code": "invalid_body", "message": "bad"}}
    object_store.put_bytes(file_key(project_id, output_id), json.dumps(answer).encode() + b"\n")
    object_store.put_bytes(file_key(project_id, error_id), json.dumps(error).encode() + b"\n")
    with sessions.begin() as session:
        session.execute(
            update(Batch)
            .where(Batch.id == batch.id)
            .values(status=BatchStatus.cancelled, cancelled_at=utcnow(), completed_requests=1, failed_requests=1,
                    output_file_id=output_id, error_file_id=error_id)
        )
    with sessions() as session:
        row = session.get(Batch, batch.id)
        assert row is not None
        counts = request_counts(row)
        assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 1, 1, 1, 0)
        results = {line["custom_id"]: line["result"] for line in map(json.loads, result_lines(object_store, row))}
    assert results == {
        "done": {"type": "succeeded", "message": {"id": "msg_1"}},
        "failed": {"type": "errored", "error": {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}},
        "never": {"type": "canceled"},
    }
