"""Webhook endpoints: what a project registers (URL, events, signing secret), and the deliveries it can read back.

Events and their delivery are `jobs.webhooks.events` and `jobs.webhooks.delivery`; the SSRF guard is
`jobs.webhooks.targets`, the signatures `jobs.webhooks.signing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import Row, delete, select
from sqlalchemy.orm import Session

from jobs.errors import ServiceError
from jobs.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent, utcnow
from jobs.pagination import Page, paginate, paginate_within
from jobs.webhooks.events import EVENT_TYPES
from jobs.webhooks.signing import new_signing_secret
from jobs.webhooks.targets import AllowList, WebhookTargetRefused, resolve_target

ENDPOINT_NAME_MAX_LENGTH = 256  # WebhookEndpoint.name's column


@dataclass(frozen=True)
class DeliveryHistory:
    delivery: Row[Any]  # of plain_columns(WebhookDelivery)
    event: WebhookEvent
    attempts: list[WebhookAttempt]  # in order


@dataclass(frozen=True)
class DeliveryPage:
    deliveries: list[DeliveryHistory]
    has_more: bool


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


def list_endpoints(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[Row[Any]]:
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
