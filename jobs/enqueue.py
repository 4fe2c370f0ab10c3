"""Sending the service's Celery tasks, by name: what the API, the pipeline and the sweeps use to queue work.

Only task names cross here (`jobs.celery_app.TaskName`), never the task functions: the API process imports neither
the tasks nor the worker, and the worker's pipeline is handed these functions when the worker wires it.
"""

from __future__ import annotations

from jobs.celery_app import CONTROL_QUEUE, TaskName, celery_app, message_priority
from jobs.served_models import UNROUTED_QUEUE, model_queue


def validate(batch_id: str, model: str | None = None) -> None:
    """Validate on any worker, or on one serving `model` (which the batch's lines need to be read with)."""
    celery_app.send_task(TaskName.validate, (batch_id,), queue=CONTROL_QUEUE if model is None else model_queue(model))


def chunk_queue(model: str | None) -> str:
    """The queue of a batch's chunks: its model's, which only workers serving it consume."""
    return UNROUTED_QUEUE if model is None else model_queue(model)


def run_chunk(batch_id: str, index: int, batch_priority: int, model: str | None) -> None:
    celery_app.send_task(
        TaskName.run_chunk, (batch_id, index), queue=chunk_queue(model), priority=message_priority(batch_priority)
    )


def finalize(batch_id: str) -> None:
    celery_app.send_task(TaskName.finalize, (batch_id,))


def webhook_deliveries(delivery_ids: list[str]) -> None:
    for delivery_id in delivery_ids:
        celery_app.send_task(TaskName.deliver_webhook, (delivery_id,))
