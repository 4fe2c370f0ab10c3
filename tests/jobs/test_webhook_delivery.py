"""Webhook events and their delivery against a real PostgreSQL and a real HTTP receiver (no worker: the tests call
the functions the Celery tasks call)."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from datetime import timedelta

import openai
import pytest
from sqlalchemy import select

from jobs.db import SessionFactory, make_engine, make_session_factory
from jobs.models import (
    Batch,
    BatchStatus,
    DeliveryStatus,
    Project,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    utcnow,
)
from jobs.webhooks.signing import new_signing_secret
from jobs.webhooks.targets import AllowList
from jobs.webhooks.delivery import MAX_ATTEMPTS, DeliveryPolicy, attempt_delivery, send_due_deliveries
from jobs.webhooks.endpoints import create_endpoint, list_deliveries
from jobs.webhooks.events import record_batch_event
from tests.webhook_receiver import WebhookReceiver, running_receiver

LOOPBACK_ALLOWED = AllowList.parse("127.0.0.1")
FAST_RETRIES = DeliveryPolicy(LOOPBACK_ALLOWED, retry_scale=1e-4)  # 0.5 ms ... 3.6 s between attempts
SDK = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")


@pytest.fixture(scope="module")
def sessions(database_url: str) -> Iterator[SessionFactory]:
    engine = make_engine(database_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def project_id(sessions: SessionFactory) -> str:
    with sessions.begin() as session:
        project = Project(name=f"webhooks-{secrets.token_hex(4)}")
        session.add(project)
        session.flush()
        return project.id


def register(sessions: SessionFactory, project_id: str, url: str, events: list[str] | None = None) -> WebhookEndpoint:
    with sessions.begin() as session:
        return create_endpoint(session, project_id, url=url, events=events, allow_list=LOOPBACK_ALLOWED)


def finish_batch(
    sessions: SessionFactory, project_id: str, status: BatchStatus, webhook_endpoint_id: str | None = None
) -> tuple[str, list[str]]:
    """A batch that has just reached `status`, and the deliveries its event created."""
    with sessions.begin() as session:
        batch = Batch(
            project_id=project_id,
            input_file_id="file-x",
            endpoint="/v1/completions",
            completion_window="24h",
            expires_at=utcnow() + timedelta(hours=24),
            webhook_endpoint_id=webhook_endpoint_id,
        )
        session.add(batch)
        session.flush()
        batch.status = status
        return batch.id, record_batch_event(session, batch)


def attempts_of(sessions: SessionFactory, delivery_id: str) -> list[WebhookAttempt]:
    with sessions() as session:
        return list(
            session.scalars(
                select(WebhookAttempt).where(WebhookAttempt.delivery_id == delivery_id).order_by(WebhookAttempt.number)
            )
        )


def delivery_row(sessions: SessionFactory, delivery_id: str) -> WebhookDelivery:
    with sessions() as session:
        row = session.get(WebhookDelivery, delivery_id)
        assert row is not None
        return row


def test_an_event_goes_to_each_subscribed_endpoint_once_signed(sessions: SessionFactory, project_id: str) -> None:
    with running_receiver(WebhookReceiver()) as first, running_receiver(WebhookReceiver()) as failures_only:
        everything = register(sessions, project_id, first.url)
        only_failed = register(sessions, project_id, failures_only.url, events=["batch.failed"])
        batch_id, deliveries = finish_batch(sessions, project_id, BatchStatus.completed)
        assert len(deliveries) == 1  # batch.completed: only the endpoint subscribed to it

        with sessions.begin() as session:  # a finalize that runs again records nothing new
            batch = session.get(Batch, batch_id)
            assert batch is not None and record_batch_event(session, batch) == []

        assert attempt_delivery(sessions, FAST_RETRIES, due_by=utcnow(), delivery_id=deliveries[0]) == deliveries[0]
        assert attempt_delivery(sessions, FAST_RETRIES, due_by=utcnow(), delivery_id=deliveries[0]) is None

    (request,) = first.received
    assert request.path == "/hooks/conveyor" and request.headers["content-type"] == "application/json"
    event = SDK.webhooks.unwrap(request.body, request.headers, secret=everything.secret)
    assert event.type == "batch.completed" and event.data.id == batch_id and event.id.startswith("evt_")
    assert event.object == "event" and abs(event.created_at - utcnow().timestamp()) < 60
    assert failures_only.received == [] and only_failed.id != everything.id
    (attempt,) = attempts_of(sessions, deliveries[0])
    assert (attempt.number, attempt.status_code, attempt.succeeded, attempt.error) == (1, 200, True, None)
    assert attempt.latency_ms > 0
    done = delivery_row(sessions, deliveries[0])
    assert done.status == DeliveryStatus.succeeded and done.finished_at and done.next_attempt_at is None


def test_a_batch_naming_an_endpoint_notifies_only_that_one(sessions: SessionFactory, project_id: str) -> None:
    chosen = register(sessions, project_id, "http://127.0.0.1:9/a")
    register(sessions, project_id, "http://127.0.0.1:9/b")
    _, deliveries = finish_batch(sessions, project_id, BatchStatus.cancelled, webhook_endpoint_id=chosen.id)
    assert [delivery_row(sessions, d).endpoint_id for d in deliveries] == [chosen.id]


def test_two_failures_then_success_is_one_success_after_three_attempts(
    sessions: SessionFactory, project_id: str
) -> None:
    with running_receiver(WebhookReceiver(statuses=[500, 503, 200])) as receiver:
        endpoint = register(sessions, project_id, receiver.url)
        batch_id, (delivery_id,) = finish_batch(sessions, project_id, BatchStatus.failed)
        for _ in range(40):
            send_due_deliveries(sessions, FAST_RETRIES)
            if delivery_row(sessions, delivery_id).status != DeliveryStatus.pending:
                break
            threading.Event().wait(0.05)
        # Sent again, a succeeded delivery makes no attempt: the three below stay three. (Not "nothing is sent": the
        # module's earlier tests leave deliveries to closed ports that come due again.)
        for _ in range(3):
            send_due_deliveries(sessions, FAST_RETRIES)

    attempts = attempts_of(sessions, delivery_id)
    outcomes = [(a.number, a.status_code, a.succeeded) for a in attempts]
    assert outcomes == [(1, 500, False), (2, 503, False), (3, 200, True)]
    assert attempts[0].error == "HTTP 500" and attempts[2].error is None
    assert delivery_row(sessions, delivery_id).status == DeliveryStatus.succeeded
    # Every attempt carries the same webhook-id (the event's), so a receiver can drop duplicates.
    assert len({request.headers["webhook-id"] for request in receiver.received}) == 1
    for request in receiver.received:
        assert SDK.webhooks.unwrap(request.body, request.headers, secret=endpoint.secret).data.id == batch_id

    with sessions() as session:
        page = list_deliveries(session, project_id, endpoint.id, after=None, limit=10)
    (history,) = page.deliveries
    assert history.event.type == "batch.failed" and [a.number for a in history.attempts] == [1, 2, 3]


def test_a_delivery_gives_up_after_the_last_attempt(sessions: SessionFactory, project_id: str) -> None:
    with running_receiver(WebhookReceiver(statuses=[500])) as receiver:
        register(sessions, project_id, receiver.url)
        _, (delivery_id,) = finish_batch(sessions, project_id, BatchStatus.expired)
        for _ in range(400):
            send_due_deliveries(sessions, DeliveryPolicy(LOOPBACK_ALLOWED, retry_scale=1e-5))
            if delivery_row(sessions, delivery_id).status != DeliveryStatus.pending:
                break
            threading.Event().wait(0.02)
    assert len(receiver.received) == MAX_ATTEMPTS >= 8
    given_up = delivery_row(sessions, delivery_id)
    assert given_up.status == DeliveryStatus.failed and given_up.attempts == MAX_ATTEMPTS
    assert [a.number for a in attempts_of(sessions, delivery_id)] == list(range(1, MAX_ATTEMPTS + 1))


def test_the_retry_schedule_spreads_attempts_over_hours() -> None:
    policy = DeliveryPolicy(LOOPBACK_ALLOWED, retry_scale=1.0)
    delays = [policy.delay_after(n).total_seconds() for n in range(1, MAX_ATTEMPTS)]
    assert 4 <= delays[0] <= 6 and delays[1] >= 240 and delays[-1] >= 8 * 3600
    assert sum(delays) > 20 * 3600
    assert len({policy.delay_after(1) for _ in range(20)}) > 1  # jittered


def test_two_senders_at_once_make_one_attempt(sessions: SessionFactory, project_id: str) -> None:
    with running_receiver(WebhookReceiver(delay_s=0.5)) as receiver:
        register(sessions, project_id, receiver.url)
        _, (delivery_id,) = finish_batch(sessions, project_id, BatchStatus.completed)
        results: list[str | None] = []
        senders = [
            threading.Thread(
                target=lambda: results.append(
                    attempt_delivery(sessions, FAST_RETRIES, due_by=utcnow(), delivery_id=delivery_id)
                )
            )
            for _ in range(2)
        ]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
    assert sorted(results, key=str) == [None, delivery_id]
    assert len(receiver.received) == 1 and len(attempts_of(sessions, delivery_id)) == 1


def test_refused_at_send_time_and_redirects_not_followed(sessions: SessionFactory, project_id: str) -> None:
    strict = DeliveryPolicy(AllowList.parse(""), retry_scale=1e-4)
    with running_receiver(WebhookReceiver()) as receiver, running_receiver(
        WebhookReceiver(statuses=[302], location="http://127.0.0.1:9/elsewhere")
    ) as redirecting:
        # Allowed when registered, not any more when sent; and a row the guard never saw (localhost is loopback).
        register(sessions, project_id, receiver.url, events=["batch.completed"])
        with sessions.begin() as session:
            by_name = receiver.url.replace("127.0.0.1", "localhost")
            secret = new_signing_secret()
            session.add(
                WebhookEndpoint(
                    project_id=project_id, url=by_name, name="by name", events=["batch.completed"], secret=secret
                )
            )
        _, refused = finish_batch(sessions, project_id, BatchStatus.completed)
        for delivery_id in refused:
            attempt_delivery(sessions, strict, due_by=utcnow(), delivery_id=delivery_id)

        register(sessions, project_id, redirecting.url, events=["batch.cancelled"])
        _, (redirected,) = finish_batch(sessions, project_id, BatchStatus.cancelled)
        attempt_delivery(sessions, FAST_RETRIES, due_by=utcnow(), delivery_id=redirected)

    assert receiver.received == [] and len(refused) == 2
    errors = sorted(attempts_of(sessions, delivery_id)[0].error or "" for delivery_id in refused)
    assert errors[0].startswith("refused: webhooks cannot be sent to 127.0.0.1: a loopback address")
    assert errors[1].startswith("refused: webhooks cannot be sent to localhost: it resolves to 127.0.0.1")
    (attempt,) = attempts_of(sessions, redirected)
    assert attempt.status_code == 302 and not attempt.succeeded and "not followed" in (attempt.error or "")
    assert [request.path for request in redirecting.received] == ["/hooks/conveyor"]
    assert delivery_row(sessions, redirected).status == DeliveryStatus.pending  # it will try again later
