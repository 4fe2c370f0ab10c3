"""Webhook events: the one a batch's end creates, with a delivery due now to each subscribed endpoint.

When a batch reaches a terminal status, `record_batch_event` (called in the transaction that sets the status)
adds one event and one delivery per subscribed endpoint; the event is unique per batch and type, so a step that
runs twice adds nothing. The deliveries are sent by `jobs.webhooks.delivery`.
"""

from __future__ import annotations

import json

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from jobs.models import Batch, BatchStatus, DeliveryStatus, WebhookDelivery, WebhookEndpoint, WebhookEvent, new_id, utcnow

EVENT_TYPE_BY_STATUS = {
    BatchStatus.completed: "batch.completed",
    BatchStatus.failed: "batch.failed",
    BatchStatus.cancelled: "batch.cancelled",
    BatchStatus.expired: "batch.expired",
}
EVENT_TYPES = tuple(EVENT_TYPE_BY_STATUS.values())


def record_batch_event(session: Session, batch: Batch) -> list[str]:
    """In the transaction that moved `batch` to a terminal status: its event, and a delivery due now to each
    subscribed endpoint of its project (only its own endpoint, for a batch that names one). Returns the new
    deliveries' ids, to enqueue once the transaction has committed; a second call for the same batch and
    status adds nothing and returns none."""
    event_type = EVENT_TYPE_BY_STATUS.get(batch.status)
    if event_type is None:
        raise ValueError(f"batch {batch.id} is {batch.status.value}, which is not a terminal status")
    now = utcnow()
    event_id = session.scalar(
        insert(WebhookEvent)
        .values(id=new_id("evt_"), project_id=batch.project_id, type=event_type, batch_id=batch.id, created_at=now)
        .on_conflict_do_nothing(constraint="uq_webhook_events_batch_type")
        .returning(WebhookEvent.id)
    )
    if event_id is None:
        return []
    subscribed = select(WebhookEndpoint.id).where(
        WebhookEndpoint.project_id == batch.project_id, WebhookEndpoint.events.contains([event_type])
    )
    if batch.webhook_endpoint_id is not None:
        subscribed = subscribed.where(WebhookEndpoint.id == batch.webhook_endpoint_id)
    deliveries = [
        WebhookDelivery(
            id=new_id("whd_"),
            event_id=event_id,
            endpoint_id=endpoint_id,
            status=DeliveryStatus.pending,
            attempts=0,
            next_attempt_at=now,
            created_at=now,
        )
        for endpoint_id in session.scalars(subscribed)
    ]
    session.add_all(deliveries)
    return [delivery.id for delivery in deliveries]


def event_body(event: WebhookEvent) -> bytes:
    """OpenAI's webhook event object."""
    return json.dumps(
        {
            "id": event.id,
            "object": "event",
            "type": event.type,
            "created_at": int(event.created_at.timestamp()),
            "data": {"id": event.batch_id},
        },
        separators=(",", ":"),
    ).encode()
