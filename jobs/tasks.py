"""Celery tasks: thin wrappers that hand each step to the worker's `Pipeline`."""

from __future__ import annotations

from celery import Task

from jobs.celery_app import celery_app
from jobs.pipeline import ChunkBusy


def _pipeline():  # noqa: ANN202 - imported late: only workers hold an engine
    from jobs.worker import get_pipeline

    return get_pipeline()


@celery_app.task(name="conveyor.validate", autoretry_for=(Exception,), retry_backoff=True, max_retries=8)
def validate(batch_id: str) -> None:
    _pipeline().validate(batch_id)


@celery_app.task(name="conveyor.run_chunk", bind=True, autoretry_for=(Exception,), retry_backoff=True, max_retries=8)
def run_chunk(self: Task, batch_id: str, index: int) -> None:
    try:
        _pipeline().run_chunk(batch_id, index)
    except ChunkBusy as busy:
        # Not an error: the chunk is running elsewhere. Come back when its lease would have lapsed, then skip or take over.
        raise self.retry(exc=busy, countdown=_pipeline().settings.chunk_lease_seconds / 2, max_retries=None) from None


@celery_app.task(name="conveyor.finalize", autoretry_for=(Exception,), retry_backoff=True, max_retries=8)
def finalize(batch_id: str) -> None:
    _pipeline().finalize(batch_id)


def enqueue_validate(batch_id: str) -> None:
    validate.delay(batch_id)


def enqueue_run_chunk(batch_id: str, index: int) -> None:
    run_chunk.delay(batch_id, index)


def enqueue_finalize(batch_id: str) -> None:
    finalize.delay(batch_id)
