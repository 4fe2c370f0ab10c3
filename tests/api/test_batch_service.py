"""The whole service, end to end, driven by the official `openai` SDK: a real uvicorn API, a real Celery worker
process holding SmolLM2, PostgreSQL, Redis and SeaweedFS."""

from __future__ import annotations

import base64
import io
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Batch

from jobs.settings import Settings
from tests.stack_fixtures import Stack, running_stack

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_TOKENS = 8


def chat_line(custom_id: str, question: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {
            "messages": [{"role": "user", "content": question}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            **body,
        },
    }


def completion_line(custom_id: str, prompt: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": COMPLETIONS,
        "body": {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **body},
    }


def image_line(custom_id: str, size: tuple[int, int]) -> dict[str, Any]:
    from PIL import Image

    image = io.BytesIO()
    Image.new("L", size).save(image, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {**chat_line(custom_id, "x"), "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 4}}


def jsonl(lines: list[dict[str, Any] | str]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def client_for(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=stack.base_url, max_retries=0, timeout=30)


def wait_for(
    client: openai.OpenAI,
    batch_id: str,
    timeout_s: float = 300.0,
    until: tuple[str, ...] = ("completed", "failed", "cancelled", "expired"),
) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status} after {timeout_s} s: {batch}"
        time.sleep(0.5)


def read_jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line]


def chat_file(prefix: str, count: int) -> tuple[bytes, set[str], dict[str, str]]:
    """`count` good chat requests and a spread of bad lines; returns the file, the good ids, bad id -> error code."""
    good = [chat_line(f"{prefix}-{i}", f"Name a color. Request {i}.") for i in range(count - 1)]
    good.append(chat_line(f"{prefix}-paris", "What is the capital of France? Answer in one word.", max_tokens=16))
    bad: list[tuple[dict[str, Any] | str, str | None, str]] = [
        ("{not json", None, "invalid_json_line"),
        ('["a", "list"]', None, "invalid_json_line"),
        ({"method": "POST", "url": CHAT, "body": {}}, None, "invalid_custom_id"),
        (chat_line(f"{prefix}-0", "a duplicate custom_id"), f"{prefix}-0#dup", "duplicate_custom_id"),
        (
            completion_line(f"{prefix}-wrong-url", "wrong endpoint for this batch"),
            f"{prefix}-wrong-url",
            "mismatched_endpoint",
        ),
        (
            {**chat_line(f"{prefix}-no-messages", "x"), "body": {"max_tokens": 4}},
            f"{prefix}-no-messages",
            "invalid_body",
        ),
        (chat_line(f"{prefix}-too-long", "hi", max_tokens=10**7), f"{prefix}-too-long", "context_length_exceeded"),
        (
            chat_line(f"{prefix}-unknown-param", "hi", functions=[{"name": "f"}]),
            f"{prefix}-unknown-param",
            "invalid_body",
        ),
        # Image lines pass validate, are read when their chunk runs, and fail there: the model reads text only
        (image_line(f"{prefix}-image", (16, 16)), f"{prefix}-image", "model_not_multimodal"),
        (image_line(f"{prefix}-image-strip", (1, 100_000)), f"{prefix}-image-strip", "image_too_large"),
    ]
    lines: list[dict[str, Any] | str] = list(good)
    spacing = count // len(bad) + 1
    for position, (line, _, _) in enumerate(bad):  # spread the bad lines through the file, across chunks
        lines.insert(position * spacing + 5, line)
    expected_errors = {bad_id or f"line:{code}:{i}": code for i, (_, bad_id, code) in enumerate(bad)}
    return jsonl(lines), {line["custom_id"] for line in good}, expected_errors


def completion_file(prefix: str, count: int) -> tuple[bytes, set[str]]:
    good = [completion_line(f"{prefix}-{i}", f"Once upon a time, in story {i},") for i in range(count)]
    lines: list[dict[str, Any] | str] = [*good, "   ", completion_line(f"{prefix}-bad-temp", "x", temperature="hot")]
    return jsonl(lines), {line["custom_id"] for line in good}


def test_openai_sdk_runs_batches_with_bad_lines_to_completion(stack: Stack) -> None:
    client = client_for(stack, stack.new_key("sdk-project"))
    # 90 request lines in all, 11 of them bad. The chat batch has one chunk more than the worker runs at once, so its
    # progress is visible between chunks; the completions batch is one chunk, run beside the chat batch's last.
    chat_bytes, chat_ids, chat_errors = chat_file("chat", 72)
    completion_bytes, completion_ids = completion_file("cmpl", 7)

    chat_input = client.files.create(file=("chat.jsonl", chat_bytes), purpose="batch")
    completion_input = client.files.create(file=("completions.jsonl", completion_bytes), purpose="batch")
    assert chat_input.bytes == len(chat_bytes) and chat_input.filename == "chat.jsonl"
    assert client.files.content(chat_input.id).content == chat_bytes

    chat_batch = client.batches.create(
        input_file_id=chat_input.id, endpoint=CHAT, completion_window="24h", metadata={"nightly": "yes"}
    )
    completion_batch = client.batches.create(
        input_file_id=completion_input.id, endpoint=COMPLETIONS, completion_window="24h"
    )
    assert chat_batch.status == "validating" and chat_batch.metadata == {"nightly": "yes"}

    progress_seen: set[int] = set()
    deadline = time.monotonic() + 400
    while (current := client.batches.retrieve(chat_batch.id)).status not in ("completed", "failed"):
        progress_seen.add(current.request_counts.completed if current.request_counts else 0)
        assert time.monotonic() < deadline, current
        time.sleep(0.3)
    assert any(0 < seen < len(chat_ids) for seen in progress_seen), (
        f"no progress visible while running: {progress_seen}"
    )

    for batch_id, good_ids, expected_bad, endpoint in (
        (chat_batch.id, chat_ids, len(chat_errors), CHAT),
        (completion_batch.id, completion_ids, 1, COMPLETIONS),
    ):
        done = wait_for(client, batch_id)
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
            len(good_ids) + expected_bad,
            len(good_ids),
            expected_bad,
        )
        assert done.completed_at and done.in_progress_at and done.finalizing_at

        outputs = read_jsonl(client, done.output_file_id)
        assert Counter(line["custom_id"] for line in outputs) == Counter(good_ids)  # each exactly once
        for line in outputs:
            assert line["error"] is None and line["response"]["status_code"] == 200
            body = line["response"]["body"]
            assert body["usage"]["completion_tokens"] <= (16 if line["custom_id"].endswith("paris") else MAX_TOKENS)
            choice = body["choices"][0]
            assert choice["finish_reason"] in ("stop", "length")
            text = choice["message"]["content"] if endpoint == CHAT else choice["text"]
            assert text.strip(), line
        errors = read_jsonl(client, done.error_file_id)
        assert len(errors) == expected_bad
        assert all(line["response"] is None and line["error"]["message"].startswith("line ") for line in errors)

    chat_outputs = {
        line["custom_id"]: line for line in read_jsonl(client, client.batches.retrieve(chat_batch.id).output_file_id)
    }
    assert "Paris" in chat_outputs["chat-paris"]["response"]["body"]["choices"][0]["message"]["content"]
    chat_error_lines = read_jsonl(client, client.batches.retrieve(chat_batch.id).error_file_id)
    assert Counter(line["error"]["code"] for line in chat_error_lines) == Counter(chat_errors.values())
    with_ids = {
        line["custom_id"]: line["error"]["code"]
        for line in chat_error_lines
        if line["custom_id"] not in (None, "chat-0")
    }
    assert with_ids == {
        bad_id: code for bad_id, code in chat_errors.items() if "#" not in bad_id and not bad_id.startswith("line:")
    }

    output_file = client.files.retrieve(client.batches.retrieve(chat_batch.id).output_file_id or "")
    assert output_file.purpose == "batch_output"
    listed = client.batches.list(limit=1)
    assert [b.id for b in listed.data] == [completion_batch.id] and listed.has_more
    assert [b.id for b in client.batches.list(limit=1, after=completion_batch.id).data] == [chat_batch.id]


def test_two_projects_share_a_worker_and_cannot_see_each_other(stack: Stack) -> None:
    alice, bob = client_for(stack, stack.new_key("alice")), client_for(stack, stack.new_key("bob"))
    started = []
    for client, name in ((alice, "alice"), (bob, "bob")):
        data, _ = completion_file(name, 24)
        upload = client.files.create(file=(f"{name}.jsonl", data), purpose="batch")
        started.append(
            (
                client,
                upload,
                client.batches.create(input_file_id=upload.id, endpoint=COMPLETIONS, completion_window="24h"),
            )
        )

    (_, alice_file, alice_batch), (_, bob_file, bob_batch) = started
    assert wait_for(alice, alice_batch.id).status == "completed"
    assert wait_for(bob, bob_batch.id).status == "completed"
    for client, own_batch in ((alice, alice_batch), (bob, bob_batch)):
        outputs = read_jsonl(client, client.batches.retrieve(own_batch.id).output_file_id)
        assert len(outputs) == 24

    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(bob_file.id)
    with pytest.raises(openai.NotFoundError):
        alice.files.content(bob_file.id)
    with pytest.raises(openai.NotFoundError):
        alice.files.delete(bob_file.id)
    with pytest.raises(openai.NotFoundError):
        alice.batches.retrieve(bob_batch.id)
    with pytest.raises(openai.NotFoundError):
        alice.batches.cancel(bob_batch.id)
    with pytest.raises(openai.NotFoundError):
        alice.batches.create(input_file_id=bob_file.id, endpoint=COMPLETIONS, completion_window="24h")
    bob_output = bob.batches.retrieve(bob_batch.id).output_file_id or ""
    with pytest.raises(openai.NotFoundError):
        alice.files.content(bob_output)
    assert bob_file.id not in {f.id for f in alice.files.list()}
    assert bob_batch.id not in {b.id for b in alice.batches.list()}
    assert alice_file.id in {f.id for f in alice.files.list()}


def test_clear_errors_for_bad_requests(stack: Stack) -> None:
    key = stack.new_key("errors-project")
    client = client_for(stack, key)

    not_jsonl = client.files.create(file=("notes.txt", b"this is not JSONL\nnor is this\n"), purpose="batch")
    failed = wait_for(
        client, client.batches.create(input_file_id=not_jsonl.id, endpoint=CHAT, completion_window="24h").id
    )
    assert failed.status == "failed" and failed.errors and failed.errors.data
    assert failed.errors.data[0].code == "invalid_file_format" and "not JSONL" in (failed.errors.data[0].message or "")

    empty = client.files.create(file=("empty.jsonl", b"\n\n"), purpose="batch")
    assert (
        wait_for(
            client, client.batches.create(input_file_id=empty.id, endpoint=CHAT, completion_window="24h").id
        ).status
        == "failed"
    )

    with pytest.raises(openai.BadRequestError) as wrong_endpoint:
        client.batches.create(input_file_id=not_jsonl.id, endpoint="/v1/embeddingz", completion_window="24h")  # type: ignore[arg-type]
    assert wrong_endpoint.value.body["param"] == "endpoint"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=not_jsonl.id, endpoint=CHAT, completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.batches.create(input_file_id="file-doesnotexist", endpoint=CHAT, completion_window="24h")
    assert "file-doesnotexist" in str(unknown.value)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-doesnotexist")
    with pytest.raises(openai.BadRequestError) as bad_purpose:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert "purpose" in str(bad_purpose.value)

    with pytest.raises(openai.AuthenticationError):
        client_for(stack, "sk-conveyor-wrong").files.list()
    raw = httpx.get(f"{stack.base_url}/files")
    assert raw.status_code == 401 and raw.json()["error"]["code"] == "missing_api_key"
    assert httpx.get(f"{stack.base_url.removesuffix('/v1')}/docs").status_code == 200

    deleted = client.files.delete(not_jsonl.id)
    assert deleted.deleted and deleted.id == not_jsonl.id
    with pytest.raises(openai.NotFoundError):
        client.files.content(not_jsonl.id)


def test_uploads_over_the_limit_get_413_and_leave_nothing(service_settings: Settings, tmp_path: Path) -> None:
    from jobs.settings import replace

    from conveyor.local_stack import free_port

    small_limit = replace(service_settings, max_upload_bytes=1000, api_port=free_port())
    with running_stack(small_limit, tmp_path, with_worker=False) as own:
        client = client_for(own, own.new_key("limits"))
        with pytest.raises(openai.APIStatusError) as too_large:
            client.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
        assert too_large.value.status_code == 413 and "1000 bytes" in str(too_large.value)
        # A client that lies about the length (chunked encoding) is stopped while streaming.
        body = iter(
            [b'--b\r\nContent-Disposition: form-data; name="file"; filename="x"\r\n\r\n', b"y" * 4000, b"\r\n--b--\r\n"]
        )
        streamed = httpx.post(
            f"{own.base_url}/files",
            content=body,
            headers={"authorization": f"Bearer {client.api_key}", "content-type": "multipart/form-data; boundary=b"},
        )
        assert streamed.status_code == 413
        assert client.files.list().data == []
        ok = client.files.create(file=("small.jsonl", b'{"a": 1}\n'), purpose="batch")
        assert client.files.content(ok.id).content == b'{"a": 1}\n'
