"""Webhooks: the endpoints a project registers, the event a batch's end creates, and its delivery.

When a batch reaches a terminal status, `record_batch_event` (called in the transaction that sets the status)
adds one event and one delivery per subscribed endpoint, due now. Sending lives in the database, not in Celery
countdowns (Redis hands a long-countdown task out again after the visibility timeout): `attempt_delivery`
locks one due delivery (`FOR UPDATE SKIP LOCKED`), POSTs the event, records the attempt and the delivery's
next step, all in one transaction, so two workers never send the same attempt and a success is recorded once.
The first attempt is enqueued right after the batch's commit; later ones are picked up by beat's sweep.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from jobs.db import SessionFactory
from jobs.errors import ServiceError
from jobs.models import (
    Batch,
    BatchStatus,
    DeliveryStatus,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    new_id,
    utcnow,
)
from jobs.pagination import Page, paginate, paginate_within
from jobs.settings import Settings
from jobs.webhook_signing import new_signing_secret, signed_headers
from jobs.webhook_targets import AllowList, WebhookTargetRefused, post_to_target, resolve_target

log = logging.getLogger(__name__)

EVENT_TYPE_BY_STATUS = {
    BatchStatus.completed: "batch.completed",
    BatchStatus.failed: "batch.failed",
    BatchStatus.cancelled: "batch.cancelled",
    BatchStatus.expired: "batch.expired",
}
EVENT_TYPES = tuple(EVENT_TYPE_BY_STATUS.values())
# Wait after failed attempt n (1-based) before attempt n + 1: about 28 hours from the first to the eighth.
RETRY_DELAYS_SECONDS = (5, 5 * 60, 30 * 60, 2 * 3600, 5 * 3600, 10 * 3600, 10 * 3600)
MAX_ATTEMPTS = len(RETRY_DELAYS_SECONDS) + 1
RETRY_JITTER = 0.2  # each delay is stretched or shrunk by up to this share, so retries of many events spread out
USER_AGENT = "conveyor-webhooks/1"
ENDPOINT_NAME_MAX_LENGTH = 256  # WebhookEndpoint.name's column

# One sweep at a time per worker process: a sweep that waits on slow endpoints must not let the next beat's
# sweeps pile up and take every control slot.
_sweep_lock = threading.Lock()


@dataclass(frozen=True)
class DeliveryPolicy:
    allow_list: AllowList
    retry_scale: float  # multiplies RETRY_DELAYS_SECONDS (tests: a small fraction)

    @classmethod
    def from_settings(cls, settings: Settings) -> "DeliveryPolicy":
        return cls(AllowList.parse(settings.webhook_allowed_hosts), settings.webhook_retry_scale)

    def delay_after(self, attempts_made: int) -> timedelta:
        base = RETRY_DELAYS_SECONDS[attempts_made - 1] * self.retry_scale
        return timedelta(seconds=base * random.uniform(1 - RETRY_JITTER, 1 + RETRY_JITTER))


@dataclass(frozen=True)
class DeliveryHistory:
    delivery: WebhookDelivery
    event: WebhookEvent
    attempts: list[WebhookAttempt]  # in order


@dataclass(frozen=True)
class DeliveryPage:
    deliveries: list[DeliveryHistory]
    has_more: bool


@dataclass(frozen=True)
class AttemptOutcome:
    status_code: int | None
    error: str | None

    @property
    def succeeded(self) -> bool:
        return self.error is None


# ---------------------------------------------------------------------------------------------------------
# endpoints


def create_endpoint(
    session: Session,
    project_id: str,
    *,
    url: str,
    events: list[str] | None,
    allow_list: AllowList,
    name: str | None = None,
) -> WebhookEndpoint:
    """A new endpoint with a new signing secret, named after its URL unless `name` is given. The URL is checked
    (DNS included) before the session is used, so no connection is held while the name resolves."""
    _check_target(url, allow_list)
    now = utcnow()
    endpoint = WebhookEndpoint(
        project_id=project_id,
        url=url,
        name=name or default_endpoint_name(url),
        events=_checked_events(events),
        secret=new_signing_secret(),
        created_at=now,
        updated_at=now,
    )
    session.add(endpoint)
    session.flush()
    return endpoint


def update_endpoint(
    session: Session,
    project_id: str,
    endpoint_id: str,
    *,
    url: str | None,
    name: str | None,
    events: list[str] | None,
    allow_list: AllowList,
) -> WebhookEndpoint:
    """Replaces what is given (None: kept). A new URL passes the same check as at registration, before the
    session is used; `updated_at` moves only when something actually changed."""
    if url is not None:
        _check_target(url, allow_list)
    endpoint = get_endpoint(session, project_id, endpoint_id, for_update=True)
    wanted = {"url": url, "name": name, "events": None if events is None else _checked_events(events)}
    changed = {
        field: value for field, value in wanted.items() if value is not None and value != getattr(endpoint, field)
    }
    for field, value in changed.items():
        setattr(endpoint, field, value)
    if changed:
        endpoint.updated_at = utcnow()
    return endpoint


def rotate_secret(session: Session, project_id: str, endpoint_id: str) -> WebhookEndpoint:
    """A new signing secret, effective at once: deliveries still pending are signed with it from their next
    attempt on."""
    endpoint = get_endpoint(session, project_id, endpoint_id, for_update=True)
    endpoint.secret, endpoint.updated_at = new_signing_secret(), utcnow()
    return endpoint


def default_endpoint_name(url: str) -> str:
    """Host, port and path: tells endpoints apart in a listing without repeating any credentials or query
    string the URL carries. Only for URLs `_check_target` accepted (their port parses)."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port is not None else ""
    return f"{parts.hostname}{port}{parts.path}"[:ENDPOINT_NAME_MAX_LENGTH]


def get_endpoint(session: Session, project_id: str, endpoint_id: str, *, for_update: bool = False) -> WebhookEndpoint:
    """`for_update` locks the row, so that of two concurrent rotations neither answers a secret the other
    has already replaced."""
    query = select(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.project_id == project_id)
    endpoint = session.scalar(query.with_for_update() if for_update else query)
    if endpoint is None:
        raise ServiceError("not_found", f"No such webhook endpoint: {endpoint_id}", param="webhook_id")
    return endpoint


def list_endpoints(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[WebhookEndpoint]:
    return paginate(session, WebhookEndpoint, project_id, after=after, limit=limit)


def delete_endpoint(session: Session, project_id: str, endpoint_id: str) -> None:
    """Deletes the endpoint and, with it, its deliveries and their attempts (the foreign keys cascade)."""
    deleted = session.execute(
        delete(WebhookEndpoint)
        .where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.project_id == project_id)
        .returning(WebhookEndpoint.id)
    ).first()
    if deleted is None:
        raise ServiceError("not_found", f"No such webhook endpoint: {endpoint_id}", param="webhook_id")


def list_deliveries(
    session: Session, project_id: str, endpoint_id: str, *, after: str | None, limit: int
) -> DeliveryPage:
    """An endpoint's deliveries, newest first, each with its event and every attempt."""
    endpoint = get_endpoint(session, project_id, endpoint_id)
    page = paginate_within(
        session, WebhookDelivery, WebhookDelivery.endpoint_id == endpoint.id, after=after, limit=limit
    )
    delivery_ids = [delivery.id for delivery in page.rows]
    events = {
        event.id: event
        for event in session.scalars(
            select(WebhookEvent).where(WebhookEvent.id.in_({delivery.event_id for delivery in page.rows}))
        )
    }
    attempts: dict[str, list[WebhookAttempt]] = {delivery_id: [] for delivery_id in delivery_ids}
    for attempt in session.scalars(
        select(WebhookAttempt).where(WebhookAttempt.delivery_id.in_(delivery_ids)).order_by(WebhookAttempt.number)
    ):
        attempts[attempt.delivery_id].append(attempt)
    return DeliveryPage(
        deliveries=[DeliveryHistory(row, events[row.event_id], attempts[row.id]) for row in page.rows],
        has_more=page.has_more,
    )


def _check_target(url: str, allow_list: AllowList) -> None:
    try:
        resolve_target(url, allow_list)
    except WebhookTargetRefused as refused:
        raise ServiceError("invalid_request", str(refused), param="url") from None


def _checked_events(events: list[str] | None) -> list[str]:
    if events is None:
        return list(EVENT_TYPES)
    unknown = [event for event in events if event not in EVENT_TYPES]
    if unknown or not events:
        raise ServiceError(
            "invalid_request",
            f"event_types must be a non-empty list of {list(EVENT_TYPES)}, got {events!r}",
            param="event_types",
        )
    return list(dict.fromkeys(events))


# ---------------------------------------------------------------------------------------------------------
# events


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


# ---------------------------------------------------------------------------------------------------------
# delivery


def attempt_delivery(
    sessions: SessionFactory, policy: DeliveryPolicy, *, due_by: datetime, delivery_id: str | None = None
) -> str | None:
    """Make the next attempt of one pending delivery due by `due_by` (the given one, or the most overdue) and
    record it. Returns the delivery's id, or None when none is due or another worker holds it."""
    due = (
        select(WebhookDelivery, WebhookEndpoint, WebhookEvent)
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .where(WebhookDelivery.status == DeliveryStatus.pending, WebhookDelivery.next_attempt_at <= due_by)
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(1)
        .with_for_update(of=WebhookDelivery, skip_locked=True)
    )
    if delivery_id is not None:
        due = due.where(WebhookDelivery.id == delivery_id)
    with sessions.begin() as session:
        claimed = session.execute(due).first()
        if claimed is None:
            return None
        delivery, endpoint, event = claimed
        started_at, started = utcnow(), time.perf_counter()
        outcome = _post_event(endpoint, event, policy)
        latency_ms = (time.perf_counter() - started) * 1000
        delivery.attempts += 1
        session.add(
            WebhookAttempt(
                delivery_id=delivery.id,
                number=delivery.attempts,
                started_at=started_at,
                latency_ms=latency_ms,
                status_code=outcome.status_code,
                error=outcome.error,
                succeeded=outcome.succeeded,
            )
        )
        if outcome.succeeded or delivery.attempts >= MAX_ATTEMPTS:
            delivery.status = DeliveryStatus.succeeded if outcome.succeeded else DeliveryStatus.failed
            delivery.finished_at, delivery.next_attempt_at = utcnow(), None
        else:
            delivery.next_attempt_at = utcnow() + policy.delay_after(delivery.attempts)
        log_level = logging.INFO if outcome.succeeded else logging.WARNING
        log.log(
            log_level,
            "webhook %s (%s) to %s, attempt %d: %s in %.0f ms",
            event.type,
            delivery.id,
            endpoint.url,
            delivery.attempts,
            outcome.error or outcome.status_code,
            latency_ms,
        )
        return delivery.id


def send_due_deliveries(sessions: SessionFactory, policy: DeliveryPolicy) -> int:
    """One attempt of every delivery that was due when the sweep began; returns how many were made (none when
    this process is already sweeping)."""
    if not _sweep_lock.acquire(blocking=False):
        return 0
    try:
        due_by, attempted = utcnow(), 0
        while attempt_delivery(sessions, policy, due_by=due_by) is not None:
            attempted += 1
        return attempted
    finally:
        _sweep_lock.release()


def _post_event(endpoint: WebhookEndpoint, event: WebhookEvent, policy: DeliveryPolicy) -> AttemptOutcome:
    body = event_body(event)
    headers = {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        **signed_headers(endpoint.secret, event.id, int(time.time()), body),
    }
    try:
        answer = post_to_target(resolve_target(endpoint.url, policy.allow_list), body, headers)
    except WebhookTargetRefused as refused:
        return AttemptOutcome(status_code=None, error=f"refused: {refused}")
    except OSError as failure:
        return AttemptOutcome(status_code=None, error=f"{type(failure).__name__}: {failure}")
    if 200 <= answer.status_code < 300:
        return AttemptOutcome(status_code=answer.status_code, error=None)
    if 300 <= answer.status_code < 400:
        redirect = f"HTTP {answer.status_code}: redirect to {answer.location} not followed"
        return AttemptOutcome(status_code=answer.status_code, error=redirect)
    return AttemptOutcome(status_code=answer.status_code, error=f"HTTP {answer.status_code}")
