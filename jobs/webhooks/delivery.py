"""Webhook delivery: signed POSTs of a batch's event, retried from the database.

Sending lives in the database, not in Celery countdowns (Redis hands a long-countdown task out again after the
visibility timeout): `attempt_delivery` locks one due delivery (`FOR UPDATE SKIP LOCKED`), POSTs the event, records
the attempt and the delivery's next step, all in one transaction, so two workers never send the same attempt and a
success is recorded once. The first attempt is enqueued right after the batch's commit; later ones are picked up
by beat's sweep (`send_due_deliveries`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select

from jobs.db import SessionFactory
from jobs.models import DeliveryStatus, WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent, utcnow
from jobs.settings import Settings
from jobs.webhooks.events import event_body
from jobs.webhooks.signing import signed_headers
from jobs.webhooks.targets import AllowList, WebhookTargetRefused, post_to_target, resolve_target

log = logging.getLogger(__name__)

# Wait after failed attempt n (1-based) before attempt n + 1: about 28 hours from the first to the eighth.
RETRY_DELAYS_SECONDS = (5, 5 * 60, 30 * 60, 2 * 3600, 5 * 3600, 10 * 3600, 10 * 3600)
MAX_ATTEMPTS = len(RETRY_DELAYS_SECONDS) + 1
RETRY_JITTER = 0.2  # each delay is stretched or shrunk by up to this share, so retries of many events spread out
USER_AGENT = "conveyor-webhooks/1"

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
class AttemptOutcome:
    status_code: int | None
    error: str | None

    @property
    def succeeded(self) -> bool:
        return self.error is None


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
