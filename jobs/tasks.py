"""Celery tasks: thin wrappers that hand each step to the worker's `Pipeline`."""

from __future__ import annotations

from celery import Task

from jobs import schedules, webhooks
from jobs.celery_app import celery_app, message_priority
from jobs.models import utcnow
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


@celery_app.task(name="conveyor.expire_batches")
def expire_batches() -> None:
    # No retries: beat sends the next sweep in a few seconds anyway.
    from jobs.expiry import expire_due_batches

    pipeline = _pipeline()
    expire_due_batches(pipeline.sessions, pipeline.stop_flags, enqueue_finalize)


def enqueue_validate(batch_id: str) -> None:
    validate.delay(batch_id)


@celery_app.task(name="conveyor.fire_due_schedules")
def fire_due_schedules() -> None:
    # No retry: beat sends the next sweep within seconds, and a schedule that failed stays due for it.
    pipeline = _pipeline()
    schedules.fire_due_schedules(
        pipeline.sessions,
        pipeline.store,
        enqueue_validate,
        embedding_model=pipeline.settings.embedding_model,
        window_seconds=pipeline.settings.completion_window_seconds,
    )


def enqueue_run_chunk(batch_id: str, index: int, batch_priority: int) -> None:
    run_chunk.apply_async((batch_id, index), priority=message_priority(batch_priority))


def enqueue_finalize(batch_id: str) -> None:
    finalize.delay(batch_id)


# No retries for the webhook tasks: a failed attempt is recorded with its next time in the database, and an
# attempt that never happened (a crash, Redis down) is still due there, where beat's sweep finds it.
@celery_app.task(name="conveyor.deliver_webhook")
def deliver_webhook(delivery_id: str) -> None:
    pipeline = _pipeline()
    policy = webhooks.DeliveryPolicy.from_settings(pipeline.settings)
    webhooks.attempt_delivery(pipeline.sessions, policy, due_by=utcnow(), delivery_id=delivery_id)


@celery_app.task(name="conveyor.send_due_webhooks")
def send_due_webhooks() -> None:
    pipeline = _pipeline()
    webhooks.send_due_deliveries(pipeline.sessions, webhooks.DeliveryPolicy.from_settings(pipeline.settings))


def enqueue_webhook_deliveries(delivery_ids: list[str]) -> None:
    for delivery_id in delivery_ids:
        deliver_webhook.delay(delivery_id)
