"""Webhooks through the whole service: endpoints registered over HTTP, batches run by a real worker, events
POSTed to a real receiver and verified with the `openai` SDK, retries sent by a real beat."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.webhooks import WebhookEndpointWithSecret

from conveyor.local_stack import ManagedProcess, free_port, scratch_redis_prefix, start_beat
from jobs.settings import Settings, replace
from tests.api.test_batch_service import COMPLETIONS, client_for, completion_file, wait_for
from tests.stack_fixtures import REDIS_URL, Stack, running_stack
from tests.webhook_receiver import ReceivedRequest, WebhookReceiver, running_receiver

SDK = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")


@pytest.fixture(scope="module")
def webhook_settings(service_settings: Settings) -> Iterator[Settings]:
    with scratch_redis_prefix(REDIS_URL) as prefix:
        yield replace(
            service_settings,
            redis_prefix=prefix,
            api_port=free_port(),
            webhook_allowed_hosts="127.0.0.1",  # the test receiver
            webhook_retry_scale=0.01,  # 50 ms, 3 s, 18 s, ...
            beat_interval_seconds=1,
        )


@pytest.fixture(scope="module")
def api_only(webhook_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(webhook_settings, tmp_path_factory.mktemp("webhooks-api"), with_worker=False) as stack:
        yield stack


def api(stack: Stack, key: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.request(method, stack.base_url + path, headers=headers, timeout=30, **kwargs)


def shown_part(signing_secret_hint: str | None) -> str:
    """The start of the secret that a hint shows."""
    return (signing_secret_hint or "").rstrip("…")


def test_endpoints_are_managed_with_the_sdk(api_only: Stack) -> None:
    key = api_only.new_key("hooks-crud")
    client, other = client_for(api_only, key), client_for(api_only, api_only.new_key("hooks-other"))
    endpoint = client.webhooks.create(url="http://127.0.0.1:9/in", event_types=["batch.failed"], name="failures")
    assert endpoint.id.startswith("wh_") and endpoint.object == "webhook_endpoint" and endpoint.name == "failures"
    assert endpoint.event_types == ["batch.failed"] and endpoint.signing_secret.startswith("whsec_")
    assert endpoint.updated_at == endpoint.created_at
    # The path and field name the issue asked for; no name: the URL's host and path, not its query string.
    body = {"url": "http://127.0.0.1:9/ends?token=t", "events": ["batch.expired", "batch.cancelled"]}
    legacy = api(api_only, key, "POST", "/webhooks", json=body)
    assert legacy.status_code == 200, legacy.text
    ends = legacy.json()
    assert ends["name"] == "127.0.0.1:9/ends" and ends["signing_secret"].startswith("whsec_")
    assert ends["event_types"] == ["batch.expired", "batch.cancelled"]

    first_page = client.webhooks.list(limit=1)
    assert [row.id for row in first_page.data] == [ends["id"]] and first_page.has_more
    assert [row.id for row in first_page.get_next_page().data] == [endpoint.id]
    assert [row.id for row in client.webhooks.list()] == [ends["id"], endpoint.id]
    retrieved = client.webhooks.retrieve(endpoint.id)
    assert "signing_secret" not in retrieved.to_dict()  # shown by create and rotate_secret only
    assert endpoint.signing_secret.startswith(shown_part(retrieved.signing_secret_hint))

    time.sleep(1.1)  # updated_at counts whole seconds
    moved = client.webhooks.update(
        endpoint.id, url="http://127.0.0.1:9/moved", name="batch ends", event_types=["batch.completed", "batch.failed"]
    )
    assert (moved.url, moved.name, moved.event_types) == (
        "http://127.0.0.1:9/moved",
        "batch ends",
        ["batch.completed", "batch.failed"],
    )
    assert moved.created_at == endpoint.created_at and (moved.updated_at or 0) > (endpoint.updated_at or 0)
    time.sleep(1.1)
    assert client.webhooks.update(endpoint.id, name="batch ends").updated_at == moved.updated_at  # no change
    with pytest.raises(openai.BadRequestError) as private:
        client.webhooks.update(endpoint.id, url="http://10.1.2.3/hook")  # the registration check, again
    assert private.value.param == "url" and client.webhooks.retrieve(endpoint.id).url == moved.url

    rotated = client.webhooks.rotate_secret(endpoint.id)
    assert rotated.signing_secret.startswith("whsec_") and rotated.signing_secret != endpoint.signing_secret
    assert rotated.signing_secret.startswith(shown_part(client.webhooks.retrieve(endpoint.id).signing_secret_hint))
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.webhooks.rotate_secret(endpoint.id, keep_old_secret_active_for_24_hours=True)
    for prefix in ("/webhook_endpoints", "/webhooks"):
        deliveries = api(api_only, key, "GET", f"{prefix}/{endpoint.id}/deliveries").json()
        assert deliveries["data"] == [] and not deliveries["has_more"]

    for someone_elses in (
        other.webhooks.retrieve,
        other.webhooks.delete,
        other.webhooks.rotate_secret,
        lambda endpoint_id: other.webhooks.update(endpoint_id, name="taken"),
    ):
        with pytest.raises(openai.NotFoundError):
            someone_elses(endpoint.id)
    assert other.webhooks.list().data == []
    deleted = client.webhooks.delete(endpoint.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (endpoint.id, "webhook_endpoint.deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.webhooks.retrieve(endpoint.id)
    assert api(api_only, key, "GET", f"/webhook_endpoints/{endpoint.id}/deliveries").status_code == 404


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"url": "http://10.1.2.3/hook"}, "10.1.2.3: a private address"),
        ({"url": "http://169.254.169.254/latest/meta-data/"}, "cloud metadata address"),
        ({"url": "http://[::1]:8080/"}, "loopback"),  # the allow-list names 127.0.0.1 only
        ({"url": "http://0.0.0.0:8080/"}, "unspecified"),
        ({"url": "ftp://example.com/"}, "only http and https"),
        ({"url": "http://127.0.0.1:9/", "event_types": ["batch.exploded"]}, "event_types must be"),
        ({"url": "http://127.0.0.1:9/", "event_types": []}, "event_types must be"),
    ],
)
def test_refused_registrations_get_400_with_the_reason(api_only: Stack, params: dict[str, Any], message: str) -> None:
    client = client_for(api_only, api_only.new_key("hooks-refused"))
    with pytest.raises(openai.BadRequestError) as refused:
        client.webhooks.create(**{"event_types": ["batch.completed"], "name": "refused", **params})
    assert message in refused.value.message and refused.value.param in ("url", "event_types")


@pytest.fixture(scope="module")
def full_stack(webhook_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """API, worker and beat: retries after the first attempt come from beat's sweep."""
    folder = tmp_path_factory.mktemp("webhooks-stack")
    settings = replace(webhook_settings, api_port=free_port())
    with running_stack(settings, folder) as stack:
        beat: ManagedProcess = start_beat(settings, folder / "beat.log")
        try:
            yield stack
        finally:
            beat.stop()


def verified(requests: list[ReceivedRequest], secret: str) -> list[tuple[str, str]]:
    """(event type, batch id) of each request, each one's signature checked by the openai SDK."""
    events = [SDK.webhooks.unwrap(request.body, request.headers, secret=secret) for request in requests]
    return [(event.type, event.data.id) for event in events]


@pytest.mark.slow
def test_batch_events_reach_the_receiver_signed_and_retried(full_stack: Stack) -> None:
    key = full_stack.new_key("hooks-e2e")
    client = client_for(full_stack, key)
    with running_receiver(WebhookReceiver(statuses=[500, 200])) as receiver:
        # Without name and event_types (the SDK always sends both): every batch.* event.
        created = api(full_stack, key, "POST", "/webhook_endpoints", json={"url": receiver.url})
        endpoint = WebhookEndpointWithSecret.model_validate(created.json())
        assert sorted(endpoint.event_types) == ["batch.cancelled", "batch.completed", "batch.expired", "batch.failed"]

        data, _ = completion_file("hooks", 3)
        upload = client.files.create(file=("hooks.jsonl", data), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint=COMPLETIONS, completion_window="24h")
        assert wait_for(client, batch.id, timeout_s=180).status == "completed"
        first_two = receiver.wait_for(2, timeout_s=30)  # the 500 at once, then the retry from beat's sweep

        not_jsonl = client.files.create(file=("notes.txt", b"not JSONL\n"), purpose="batch")
        doomed = client.batches.create(input_file_id=not_jsonl.id, endpoint=COMPLETIONS, completion_window="24h")
        assert wait_for(client, doomed.id).status == "failed"
        cancelled = client.batches.create(input_file_id=upload.id, endpoint=COMPLETIONS, completion_window="24h")
        with contextlib.suppress(openai.ConflictError):  # the batch may win the race and complete first
            client.batches.cancel(cancelled.id)
        cancelled_status = wait_for(client, cancelled.id).status
        everything = receiver.wait_for(4, timeout_s=30)

    assert verified(first_two, endpoint.signing_secret) == [("batch.completed", batch.id)] * 2
    assert first_two[0].headers["webhook-id"] == first_two[1].headers["webhook-id"]
    assert verified(everything[2:], endpoint.signing_secret) == [
        ("batch.failed", doomed.id),
        (f"batch.{cancelled_status}", cancelled.id),
    ]

    deliveries = api(full_stack, key, "GET", f"/webhook_endpoints/{endpoint.id}/deliveries").json()["data"]
    assert [d["batch_id"] for d in deliveries] == [cancelled.id, doomed.id, batch.id]  # newest first
    retried = deliveries[-1]
    assert retried["status"] == "succeeded" and retried["event_type"] == "batch.completed"
    assert [(a["number"], a["status_code"], a["succeeded"]) for a in retried["attempts"]] == [
        (1, 500, False),
        (2, 200, True),
    ]
    assert retried["attempts"][0]["error"] == "HTTP 500" and retried["next_attempt_at"] is None
    assert all(d["status"] == "succeeded" and len(d["attempts"]) == 1 for d in deliveries[:2])
    time.sleep(2)  # a few more sweeps: nothing is sent twice
    assert len(receiver.received) == 4
