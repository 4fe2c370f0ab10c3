"""Webhooks through the whole service: endpoints registered over HTTP, batches run by a real worker, events
POSTed to a real receiver and verified with the `openai` SDK, retries sent by a real beat."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from conveyor.local_stack import ManagedProcess, free_port, scratch_redis_prefix, start_beat
from jobs.settings import Settings
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


def test_endpoints_are_registered_listed_and_deleted(api_only: Stack) -> None:
    key, other_key = api_only.new_key("hooks-crud"), api_only.new_key("hooks-other")
    created = api(api_only, key, "POST", "/webhooks", json={"url": "http://127.0.0.1:9/in", "events": ["batch.failed"]})
    assert created.status_code == 200, created.text
    endpoint = created.json()
    assert endpoint["id"].startswith("wh_") and endpoint["object"] == "webhook_endpoint"
    assert endpoint["events"] == ["batch.failed"] and endpoint["secret"].startswith("whsec_")
    everything = api(api_only, key, "POST", "/webhooks", json={"url": "http://127.0.0.1:9/all"}).json()
    assert sorted(everything["events"]) == ["batch.cancelled", "batch.completed", "batch.expired", "batch.failed"]

    listed = api(api_only, key, "GET", "/webhooks", params={"limit": 1}).json()
    assert [row["id"] for row in listed["data"]] == [everything["id"]] and listed["has_more"]
    following = api(api_only, key, "GET", "/webhooks", params={"after": everything["id"]}).json()
    assert [row["id"] for row in following["data"]] == [endpoint["id"]]
    retrieved = api(api_only, key, "GET", f"/webhooks/{endpoint['id']}").json()
    assert "secret" not in retrieved and "secret" not in listed["data"][0]  # shown once, when created
    assert endpoint["secret"].startswith(retrieved["secret_hint"].rstrip("…"))
    deliveries = api(api_only, key, "GET", f"/webhooks/{endpoint['id']}/deliveries").json()
    assert deliveries["data"] == [] and not deliveries["has_more"]

    assert api(api_only, other_key, "GET", f"/webhooks/{endpoint['id']}").status_code == 404
    assert api(api_only, other_key, "DELETE", f"/webhooks/{endpoint['id']}").status_code == 404
    assert api(api_only, other_key, "GET", "/webhooks").json()["data"] == []
    deleted = api(api_only, key, "DELETE", f"/webhooks/{endpoint['id']}").json()
    assert deleted == {"id": endpoint["id"], "object": "webhook_endpoint.deleted", "deleted": True}
    assert api(api_only, key, "GET", f"/webhooks/{endpoint['id']}").status_code == 404
    assert api(api_only, key, "GET", f"/webhooks/{endpoint['id']}/deliveries").status_code == 404


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"url": "http://10.1.2.3/hook"}, "10.1.2.3: a private address"),
        ({"url": "http://169.254.169.254/latest/meta-data/"}, "cloud metadata address"),
        ({"url": "http://[::1]:8080/"}, "loopback"),  # the allow-list names 127.0.0.1 only
        ({"url": "http://0.0.0.0:8080/"}, "unspecified"),
        ({"url": "ftp://example.com/"}, "only http and https"),
        ({"url": "http://127.0.0.1:9/", "events": ["batch.exploded"]}, "events must be"),
        ({"url": "http://127.0.0.1:9/", "events": []}, "events must be"),
    ],
)
def test_refused_registrations_get_400_with_the_reason(api_only: Stack, body: dict[str, Any], message: str) -> None:
    refused = api(api_only, api_only.new_key("hooks-refused"), "POST", "/webhooks", json=body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert message in error["message"] and error["param"] in ("url", "events")


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
        endpoint = api(full_stack, key, "POST", "/webhooks", json={"url": receiver.url}).json()

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

    assert verified(first_two, endpoint["secret"]) == [("batch.completed", batch.id)] * 2
    assert first_two[0].headers["webhook-id"] == first_two[1].headers["webhook-id"]
    assert verified(everything[2:], endpoint["secret"]) == [
        ("batch.failed", doomed.id),
        (f"batch.{cancelled_status}", cancelled.id),
    ]

    deliveries = api(full_stack, key, "GET", f"/webhooks/{endpoint['id']}/deliveries").json()["data"]
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
