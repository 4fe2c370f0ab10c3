"""Anthropic's Message Batches API end to end, driven by the official `anthropic` SDK, unmodified, against the real
service (uvicorn API, Celery worker on SmolLM2, PostgreSQL, Redis, SeaweedFS); and OpenAI's request limit on the same
stack. Few batches, small ones: each covers several behaviours."""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types.messages import MessageBatch

from tests.stack_fixtures import Stack

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def client_for(stack: Stack, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=key, base_url=stack.base_url.removesuffix("/v1"), max_retries=0, timeout=30)


def params(content: Any = "Name a colour.", **more: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": content}], **more}


def wait_until_ended(client: anthropic.Anthropic, batch_id: str, timeout_s: float = 300.0) -> MessageBatch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        assert time.monotonic() < deadline, f"{batch_id} still {batch.processing_status} after {timeout_s} s"
        time.sleep(0.5)


def test_the_anthropic_sdk_runs_a_message_batch_with_tools_and_a_bad_request(stack: Stack) -> None:
    client = client_for(stack, stack.new_key("anthropic-sdk"))
    conversation = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]},
    ]
    batch = client.messages.batches.create(
        requests=[
            {"custom_id": "plain", "params": params(system=[{"type": "text", "text": "Answer in one word."}])},
            {
                "custom_id": "tool-call",
                "params": params(
                    "Weather in Oslo?", max_tokens=48, tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "get_weather"}
                ),
            },
            {
                "custom_id": "tool-result",
                "params": {**params(), "messages": conversation, "tools": [WEATHER_TOOL], "tool_choice": {"type": "none"}},
            },
            {"custom_id": "image", "params": params([{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}])},
            {"custom_id": "no-max-tokens", "params": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}},
        ]
    )
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 5
    assert batch.results_url is None and batch.ended_at is None and batch.expires_at > batch.created_at

    ended = wait_until_ended(client, batch.id)
    counts = ended.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 3, 2, 0, 0)
    assert ended.ended_at is not None and ended.results_url is not None
    assert ended.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")

    results = {line.custom_id: line.result for line in client.messages.batches.results(batch.id)}
    assert set(results) == {"plain", "tool-call", "tool-result", "image", "no-max-tokens"}
    plain = results["plain"]
    assert plain.type == "succeeded"
    assert plain.message.role == "assistant" and plain.message.model == MODEL
    assert plain.message.stop_reason in ("end_turn", "max_tokens") and plain.message.content[0].type == "text"
    assert 0 < plain.message.usage.output_tokens <= 8 and plain.message.usage.input_tokens > 0
    call = results["tool-call"]
    assert call.type == "succeeded" and call.message.stop_reason == "tool_use"
    (tool_use,) = [block for block in call.message.content if block.type == "tool_use"]
    assert tool_use.name == "get_weather" and isinstance(tool_use.input, dict) and isinstance(tool_use.input["city"], str)
    assert results["tool-result"].type == "succeeded"
    assert [block.type for block in results["tool-result"].message.content] == ["text"]
    for bad, problem in (("image", "an image URL must be a data: URL, an https:// URL or an s3:// URI"), ("no-max-tokens", "max_tokens")):
        errored = results[bad]
        assert errored.type == "errored"
        assert errored.error.type == "error" and errored.error.error.type == "invalid_request_error"
        assert problem in errored.error.error.message

    listed = client.messages.batches.list(limit=100)
    assert batch.id in {item.id for item in listed.data}

    # Another project's key sees none of it
    stranger = client_for(stack, stack.new_key("anthropic-stranger"))
    for attempt in (
        lambda: stranger.messages.batches.retrieve(batch.id),
        lambda: list(stranger.messages.batches.results(batch.id)),
        lambda: stranger.messages.batches.cancel(batch.id),
        lambda: stranger.messages.batches.delete(batch.id),
    ):
        with pytest.raises(anthropic.NotFoundError):
            attempt()
    assert batch.id not in {item.id for item in stranger.messages.batches.list().data}

    deleted = client.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError) as gone:
        client.messages.batches.retrieve(batch.id)
    assert gone.value.body == {"type": "error", "error": {"type": "not_found_error", "message": gone.value.body["error"]["message"]}}


def test_a_canceled_message_batch_reports_its_unrun_requests_as_canceled(stack: Stack) -> None:
    client = client_for(stack, stack.new_key("anthropic-cancel"))
    requests = [{"custom_id": f"long-{index}", "params": params(f"Count to {index + 500}.", max_tokens=400)} for index in range(12)]
    batch = client.messages.batches.create(requests=requests)
    with pytest.raises(anthropic.BadRequestError, match="still processing"):
        client.messages.batches.delete(batch.id)
    canceling = client.messages.batches.cancel(batch.id)
    assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at is not None

    ended = wait_until_ended(client, batch.id)
    counts = ended.request_counts
    assert counts.canceled > 0 and counts.succeeded + counts.errored + counts.canceled == 12
    results = list(client.messages.batches.results(batch.id))
    assert len(results) == 12 and len({line.custom_id for line in results}) == 12
    assert sum(line.result.type == "canceled" for line in results) == counts.canceled
    assert client.messages.batches.cancel(batch.id).processing_status == "ended"  # cancel again: as it is


def test_a_message_batch_over_anthropics_limits_or_badly_formed_is_refused_at_creation(stack: Stack) -> None:
    client = client_for(stack, stack.new_key("anthropic-refused"))
    with pytest.raises(anthropic.BadRequestError, match="used by an earlier request"):
        client.messages.batches.create(
            requests=[{"custom_id": "twice", "params": params()}, {"custom_id": "twice", "params": params()}]
        )
    with pytest.raises(anthropic.BadRequestError, match="letters, digits"):
        client.messages.batches.create(requests=[{"custom_id": "no spaces", "params": params()}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(api_key="sk-wrong", base_url=stack.base_url.removesuffix("/v1"), max_retries=0).messages.batches.list()


def test_a_file_of_50001_requests_fails_as_openai_fails_it(stack: Stack) -> None:
    client = openai.OpenAI(api_key=stack.new_key("openai-limits"), base_url=stack.base_url, max_retries=0, timeout=60)
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}})
    upload = client.files.create(file=("many.jsonl", (line + "\n").encode() * 50_001), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 300
    while (batch := client.batches.retrieve(batch.id)).status == "validating":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data is not None
    (error,) = batch.errors.data
    assert error.code == "too_many_tasks" and "50001 requests" in (error.message or "")
