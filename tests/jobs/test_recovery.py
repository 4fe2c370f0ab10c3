"""Every batch reaches a terminal state even when its validate or finalize keeps failing, against real PostgreSQL (no
worker, no object store: the steps are driven directly, the validate task through Celery's eager mode)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from redis import Redis
from sqlalchemy import select

from jobs.celery_app import TaskName, create_celery_app
from conveyor.local_stack import scratch_database
from jobs.db import SessionFactory, make_engine, make_session_factory, upgrade
from jobs.models import Batch, BatchStatus, Chunk, ChunkStatus, Project, WebhookEndpoint, WebhookEvent, utcnow
from jobs.broker_messages import chunk_messages
from jobs.enqueue import chunk_queue
from jobs.recovery import fail_stalled_finalizes, resend_lost_chunks, resend_lost_work
from jobs.run.lease import ChunkLeases
from jobs.run.pipeline import Pipeline
from jobs.settings import S3Settings, Settings
from jobs.storage import ObjectStore
from jobs.tasks import register_tasks
from tests.stack_fixtures import POSTGRES_ADMIN_URL

TIMEOUT = 3600.0
STORE = ObjectStore(S3Settings(bucket="results", prefix="prod/"))  # only names keys here, never connects


@pytest.fixture(scope="module")
def sessions() -> Iterator[SessionFactory]:
    """A database of this module's own: the webhook events its failed batches queue must not reach the delivery
    sweeps other tests run over the shared one."""
    with scratch_database(POSTGRES_ADMIN_URL) as url:
        upgrade(url)
        engine = make_engine(url)
        yield make_session_factory(engine)
        engine.dispose()


def new_batch(sessions: SessionFactory, status: BatchStatus, since: datetime, done_chunks: int = 0) -> str:
    """A batch in `status` since `since` (its finalizing_at or cancelling_at), with a subscribed webhook."""
    with sessions.begin() as session:
        project = Project(name=f"recovery-{secrets.token_hex(4)}")
        session.add(project)
        session.flush()
        session.add(WebhookEndpoint(project_id=project.id, url="https://example.com/h", name="h", events=["batch.failed"], secret="whsec_x"))
        batch = Batch(
            project_id=project.id,
            input_file_id="file-x",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            expires_at=since + timedelta(hours=24),
            status=status,
            finalizing_at=since if status == BatchStatus.finalizing else None,
            cancelling_at=since if status == BatchStatus.cancelling else None,
        )
        session.add(batch)
        session.flush()
        session.add_all(
            Chunk(batch_id=batch.id, index=i, byte_start=0, byte_end=1, first_line=1, num_requests=1, status=ChunkStatus.done)
            for i in range(done_chunks)
        )
        return batch.id


def batch_row(sessions: SessionFactory, batch_id: str) -> Batch:
    with sessions() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        session.expunge(batch)
        return batch


def test_a_finalize_that_never_completes_fails_its_batch_after_the_timeout_keeping_its_results(
    sessions: SessionFactory,
) -> None:
    now = utcnow()
    stuck = new_batch(sessions, BatchStatus.finalizing, now - timedelta(seconds=TIMEOUT + 1), done_chunks=3)
    stuck_cancel = new_batch(sessions, BatchStatus.cancelling, now - timedelta(seconds=TIMEOUT + 1))
    recent = new_batch(sessions, BatchStatus.finalizing, now - timedelta(seconds=TIMEOUT - 60), done_chunks=1)

    deliveries = fail_stalled_finalizes(sessions, STORE, TIMEOUT, now)
    assert len(deliveries) == 2  # one batch.failed webhook per failed batch

    batch = batch_row(sessions, stuck)
    assert batch.status == BatchStatus.failed and batch.failed_at is not None
    (error,) = batch.errors or []
    assert error["code"] == "finalize_failed"
    assert "3600 s" in error["message"] and "3 finished chunks" in error["message"]
    assert f"s3://results/prod/batches/{stuck}/" in error["message"]  # where the results written so far are
    cancelled = batch_row(sessions, stuck_cancel)
    assert cancelled.status == BatchStatus.failed and "no chunk had finished" in (cancelled.errors or [])[0]["message"]
    assert batch_row(sessions, recent).status == BatchStatus.finalizing  # still within its time
    with sessions() as session:
        events = session.scalars(select(WebhookEvent.type).where(WebhookEvent.batch_id.in_([stuck, stuck_cancel]))).all()
    assert events == ["batch.failed", "batch.failed"]

    assert fail_stalled_finalizes(sessions, STORE, TIMEOUT, now + timedelta(seconds=10)) == []  # settled once


def test_a_validate_whose_retries_are_spent_fails_its_batch(
    sessions: SessionFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch_id = new_batch(sessions, BatchStatus.validating, utcnow())
    deliveries: list[str] = []
    settings = Settings(database_url="postgresql+psycopg://unused")
    pipeline = Pipeline(
        settings=settings,
        sessions=sessions,
        store=STORE,
        redis=Redis(),  # never connected: nothing here raises a flag or takes a lease
        kinds={},
        models=None,  # type: ignore[arg-type]  # validate is replaced below
        enqueue_validate=lambda *_: None,
        enqueue_run_chunk=lambda *_: None,
        enqueue_finalize=lambda _: None,
        enqueue_webhook_deliveries=deliveries.extend,
    )
    attempts = []

    def store_down(batch_id: str) -> None:
        attempts.append(batch_id)
        raise ConnectionError("the object store is unreachable")

    monkeypatch.setattr(pipeline, "validate", store_down)
    app = create_celery_app(settings)
    register_tasks(app, pipeline)
    app.tasks[TaskName.validate].apply(args=(batch_id,))  # eager: the retries run at once, one inside the other

    assert len(attempts) == 9
    batch = batch_row(sessions, batch_id)
    assert batch.status == BatchStatus.failed
    (error,) = batch.errors or []
    assert error["code"] == "validation_failed"
    assert "9 attempts failed, the last with ConnectionError" in error["message"]
    assert "unreachable" not in error["message"]  # internal details stay in the worker's log
    assert len(deliveries) == 1


def test_a_stalled_finalize_is_sent_again_at_a_doubling_pace(sessions: SessionFactory) -> None:
    """Once a minute stalled, then each re-send waits half the batch's stalled time: a finalize that keeps failing
    gets a handful of re-sends within the timeout, not one per sweep (each starting its own chain of retries)."""
    since = utcnow()
    batch_id = new_batch(sessions, BatchStatus.finalizing, since)
    sent: list[float] = []
    for second in range(0, 3600, 10):  # beat's sweep every 10 s for an hour
        resent: list[str] = []
        resend_lost_work(sessions, lambda *_: None, resent.append, since + timedelta(seconds=second))
        sent += [second] * resent.count(batch_id)
    assert sent == [60, 120, 240, 480, 960, 1920]


def test_a_pending_chunk_with_no_lease_and_no_message_is_sent_again(sessions: SessionFactory) -> None:
    """Against a real Redis: the broker's queue as Celery writes it, the leases as workers take them."""
    settings = Settings(database_url="postgresql+psycopg://unused", redis_prefix=f"test-lost-chunks-{secrets.token_hex(4)}:")
    redis = Redis.from_url(settings.redis_url)
    leases = ChunkLeases(redis, settings.redis_prefix, lease_seconds=60)
    app = create_celery_app(settings)
    now = utcnow()
    with sessions.begin() as session:
        project = Project(name=f"lost-chunks-{secrets.token_hex(4)}")
        session.add(project)
        session.flush()
        started, fresh = (
            Batch(
                project_id=project.id, input_file_id="file-x", endpoint="/v1/chat/completions", completion_window="24h",
                expires_at=now + timedelta(hours=24), status=BatchStatus.in_progress, in_progress_at=since,
            )
            for since in (now - timedelta(minutes=5), now)
        )
        session.add_all([started, fresh])
        session.flush()
        session.add_all(
            Chunk(batch_id=batch.id, index=i, byte_start=0, byte_end=1, first_line=1, num_requests=1,
                  status=ChunkStatus.done if i == 3 else ChunkStatus.pending)
            for batch in (started, fresh) for i in range(4)
        )
        started_id, fresh_id = started.id, fresh.id
    sent: list[tuple[str, int]] = []

    def resend() -> int:
        return resend_lost_chunks(
            sessions,
            leases,
            lambda models: chunk_messages(redis, settings.redis_prefix, {chunk_queue(model) for model in models}),
            lambda batch_id, index, *_: sent.append((batch_id, index)),
            now,
        )

    try:
        with app.connection_for_write() as connection:  # chunk 1's task waits in its queue
            app.send_task(TaskName.run_chunk, (started_id, 1), queue=chunk_queue(None), priority=5, connection=connection)
        with leases.hold(started_id, 0):  # chunk 0 runs; chunk 2 has neither; chunk 3 is done
            assert resend() == 1
        # Only the started batch's lost chunk: the fresh batch's tasks may still be on their way from validate.
        assert sent == [(started_id, 2)]
    finally:
        for key in redis.scan_iter(f"{settings.redis_prefix}*"):
            redis.delete(key)
        redis.close()
    assert fresh_id not in {batch_id for batch_id, _ in sent}
