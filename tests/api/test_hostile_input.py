"""The API under hostile or careless input, on a real uvicorn API process with PostgreSQL, Redis and SeaweedFS (no
worker): nothing a client sends answers 500; errors have OpenAI's shape; create requests are idempotent with an
`Idempotency-Key`; a batch created while Redis is down answers 503 and is picked up by the recovery sweep."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis
from sqlalchemy import delete, select

from conveyor.local_stack import free_port
from jobs import db
from jobs.models import Batch, BatchStatus
from jobs.recovery import resend_lost_work
from jobs.settings import Settings, replace
from tests.stack_fixtures import Stack, running_stack

# Short: the batches made of it run on the session's shared worker, when one is up (`api_only_stack` shares its queues).
LINE = {
    "custom_id": "a",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


@pytest.fixture(scope="module")
def http(api_only_stack: Stack) -> Iterator[httpx.Client]:
    key = api_only_stack.new_key(f"hostile-{uuid.uuid4().hex[:8]}")
    with httpx.Client(
        base_url=api_only_stack.base_url.removesuffix("/v1"), headers={"Authorization": f"Bearer {key}"}, timeout=30
    ) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert not error["message"].startswith("Invalid the "), error  # a reliability run read "Invalid the request: …"
    return error


def upload(http: httpx.Client, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return http.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}, headers=headers)


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/batches/batch_%00x"),
        ("GET", "/v1/batches?after=batch_%00"),
        ("GET", "/v1/files/file-%00"),
        ("GET", "/v1/files?purpose=%00&after=%00"),
        ("GET", "/v1/files/file-%00/content"),
        ("DELETE", "/v1/files/file-%00"),
        ("POST", "/v1/batches/batch_%00/cancel"),
        ("GET", "/v1/webhooks/we_%00"),
        ("GET", "/v1/schedules/%00/runs?after=%00"),
        ("GET", "/v1/rag/jobs/%00"),
    ],
)
def test_a_nul_byte_in_an_id_or_query_answers_400(http: httpx.Client, method: str, path: str) -> None:
    assert_openai_error(http.request(method, path), 400)


def test_a_nul_byte_in_a_json_body_answers_400(http: httpx.Client) -> None:
    body = {"input_file_id": "file-\u0000", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    assert_openai_error(http.post("/v1/batches", json=body), 400)
    body = {"input_file_id": "x", "endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {"k": "\u0000"}}
    assert http.post("/v1/batches", json=body).status_code in (400, 404)


def test_a_body_that_is_not_an_object_is_an_invalid_request(http: httpx.Client) -> None:
    error = assert_openai_error(http.post("/v1/batches", json=["a", "list"]), 400)
    assert error["message"].startswith("Invalid request: ") and error["param"] is None, error


@pytest.mark.parametrize(
    "body",
    [
        b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\nabc",  # never closed
        b"garbage without any boundary",
        b"--b\r\n\x00\x01\x02: \r\n\r\nabc\r\n--b--\r\n",  # a header line that is not a header
        b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + b"a" * 20_000 + b"\"\r\n\r\nx\r\n--b--\r\n",
        b"".join(b"--b\r\nContent-Disposition: form-data; name=\"f%d\"\r\n\r\nv\r\n" % i for i in range(100)) + b"--b--\r\n",
        b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n" + b"p" * 10_000 + b"\r\n--b--\r\n",
    ],
    ids=["unterminated", "no-boundary", "bad-header", "huge-header", "unknown-fields", "huge-field"],
)
def test_malformed_or_unbounded_multipart_answers_400(http: httpx.Client, body: bytes) -> None:
    response = http.post("/v1/files", content=body, headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert_openai_error(response, 400)


def test_a_bad_content_length_or_content_type_answers_400(http: httpx.Client) -> None:
    assert_openai_error(http.post("/v1/files", content=b"x", headers={"Content-Type": "multipart/form-data; boundary="}), 400)
    assert_openai_error(http.post("/v1/files", content=b"x", headers={"Content-Type": "text/plain"}), 400)


def test_an_unknown_query_parameter_is_refused(http: httpx.Client) -> None:
    error = assert_openai_error(http.get("/v1/batches", params={"limt": 5}), 400)
    assert error["param"] == "limt"


def test_405_names_the_allowed_methods(http: httpx.Client) -> None:
    response = http.put("/v1/batches")
    assert_openai_error(response, 405)
    assert set(response.headers["allow"].replace(" ", "").split(",")) == {"GET", "POST"}


def test_the_openapi_document_states_real_statuses(http: httpx.Client) -> None:
    document = http.get("/openapi.json").json()
    create = document["paths"]["/v1/batches"]["post"]["responses"]
    assert set(create) == {"200", "400", "401", "404", "409", "503"}
    assert create["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "413" in document["paths"]["/v1/files"]["post"]["responses"]
    assert "404" in document["paths"]["/v1/batches/{batch_id}"]["get"]["responses"]
    assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert not any("422" in op["responses"] for path in document["paths"].values() for op in path.values())


def test_a_retried_batch_creation_returns_the_first_batch(http: httpx.Client) -> None:
    file_id = upload(http, json.dumps(LINE).encode()).json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    key = {"Idempotency-Key": f"create-{uuid.uuid4()}"}
    first = http.post("/v1/batches", json=body, headers=key)
    assert first.status_code == 200, first.text
    again = http.post("/v1/batches", json=body, headers=key)
    assert again.status_code == 200 and again.json() == first.json()
    listed = [batch["id"] for batch in http.get("/v1/batches", params={"limit": 100}).json()["data"]]
    assert listed.count(first.json()["id"]) == 1
    error = assert_openai_error(http.post("/v1/batches", json={**body, "metadata": {"x": "y"}}, headers=key), 409)
    assert error["code"] == "idempotency_key_reused"
    other = http.post("/v1/batches", json=body, headers={"Idempotency-Key": f"other-{uuid.uuid4()}"})
    assert other.status_code == 200 and other.json()["id"] != first.json()["id"]
    assert_openai_error(http.post("/v1/batches", json=body, headers={"Idempotency-Key": "k" * 300}), 400)
    for made in (first, other):  # nothing left running on a shared worker (409: it has already ended)
        assert http.post(f"/v1/batches/{made.json()['id']}/cancel").status_code in (200, 409)


def test_a_retried_upload_returns_the_first_file(http: httpx.Client) -> None:
    key = {"Idempotency-Key": f"upload-{uuid.uuid4()}"}
    first = upload(http, b'{"a": 1}\n', key)
    assert first.status_code == 200, first.text
    again = upload(http, b'{"a": 1}\n', key)
    assert again.status_code == 200 and again.json() == first.json()
    assert_openai_error(upload(http, b'{"a": 2}\n', key), 409)
    files = [f["id"] for f in http.get("/v1/files").json()["data"]]
    assert files.count(first.json()["id"]) == 1


@pytest.fixture
def redis_down_stack(service_settings: Settings, tmp_path: Path) -> Iterator[Stack]:
    """The API with Redis pointed at a port where nothing listens."""
    settings = replace(service_settings, api_port=free_port(), redis_url=f"redis://127.0.0.1:{free_port()}/0")
    with running_stack(settings, tmp_path, with_worker=False) as stack:
        yield stack


def test_a_batch_created_while_redis_is_down_answers_503_and_starts_once_it_is_back(
    redis_down_stack: Stack, service_settings: Settings
) -> None:
    key = redis_down_stack.new_key(f"redis-down-{uuid.uuid4().hex[:8]}")
    with httpx.Client(base_url=redis_down_stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        file_id = http.post("/files", files={"file": ("in.jsonl", json.dumps(LINE).encode())}, data={"purpose": "batch"}).json()["id"]
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        idempotency = {"Idempotency-Key": f"down-{uuid.uuid4()}"}
        error = assert_openai_error(http.post("/batches", json=body, headers=idempotency), 503)
        assert error["code"] == "queue_unavailable"
        retried = http.post("/batches", json=body, headers=idempotency)  # the SDKs retry a 503
        assert retried.status_code == 200, retried.text
        batch_id = retried.json()["id"]
        assert batch_id in error["message"]
        assert [b["id"] for b in http.get("/batches").json()["data"]] == [batch_id]

    engine = db.make_engine(service_settings.database_url, pool_size=1)
    sessions = db.make_session_factory(engine)
    try:
        with sessions() as session:
            batch = session.get(Batch, batch_id)
            assert batch is not None and batch.status == BatchStatus.validating and batch.validate_unsent
        # Redis is back (the shared server): the sweep queues the validate, a real Celery message on a private queue
        # (a key prefix of its own: the session's shared worker consumes the test run's control queue).
        from jobs.celery_app import create_celery_app

        sweep_settings = replace(service_settings, redis_prefix=f"{service_settings.redis_prefix}sweep-{uuid.uuid4().hex[:8]}:")
        celery = create_celery_app(sweep_settings)
        sent: list[str] = []

        def enqueue_validate(batch_id: str) -> None:
            celery.send_task("conveyor.validate", (batch_id,))
            sent.append(batch_id)

        resend_lost_work(sessions, enqueue_validate, lambda _: None)
        assert batch_id in sent
        queue = Redis.from_url(sweep_settings.redis_url).lrange(sweep_settings.redis_prefix + "control", 0, -1)
        assert any(batch_id.encode() in message for message in queue)
        with sessions() as session:
            assert session.scalar(select(Batch.validate_unsent).where(Batch.id == batch_id)) is False
        sent.clear()
        resend_lost_work(sessions, enqueue_validate, lambda _: None)
        assert batch_id not in sent  # sent once
    finally:
        with sessions.begin() as session:  # its validate went to a queue nobody reads: no sweep may find it later
            session.execute(delete(Batch).where(Batch.id == batch_id))
        engine.dispose()
