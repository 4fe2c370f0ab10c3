"""/v1/responses lines: the body read like OpenAI's, state-bound fields refused per line, the answer a `response` object
that the official SDK's own `Response` type parses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response

from jobs.openai_format.records import response_record
from jobs.openai_format.requests import RESPONSES
from tests.jobs.test_openai_format import (
    WordTokenizer,
    FakeResult,
    FakeSample,
    accepted,
    as_json,
    chat_line,
    rejected,
    validator,
)


TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers",
          "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}]
CHAT_TOOLS = [{"type": "function", "function": {key: value for key, value in TOOLS[0].items() if key != "type"}}]


def responses_line(custom_id: str = "r-1", **body: Any) -> str:
    body.setdefault("input", "hello there")
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": RESPONSES, "body": body})


def test_a_string_input_with_instructions_reads_as_a_chat_with_a_system_turn() -> None:
    request = accepted(
        validator().validate(
            responses_line(instructions="be brief", max_output_tokens=5, temperature=0.5, top_p=0.9, model="smollm2")
        )
    )
    as_chat = accepted(
        validator().validate(
            chat_line(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
        )
    )
    assert request.prompts == as_chat.prompts
    params = request.sampling_params
    assert (params.max_tokens, params.temperature, params.top_p, params.n) == (5, 0.5, 0.9, 1)


def test_message_items_take_text_parts_and_every_role() -> None:
    items = [
        {"role": "developer", "content": "terse"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"role": "user", "content": "again"},
    ]
    request = accepted(validator().validate(responses_line(input=items, store=False, stream=False, metadata={"a": "b"},
                                                           text={"format": {"type": "text"}}, truncation="disabled")))
    as_chat = accepted(validator().validate(chat_line(messages=[
        {"role": "system", "content": "terse"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}])))
    assert request.prompts == as_chat.prompts


@pytest.mark.parametrize(
    ("body", "message_part"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id is not supported"),
        ({"store": True}, "store=true is not supported"),
        ({"background": True}, "background=true is not supported"),
        ({"stream": True}, "stream=true is not supported"),
        ({"tools": [{"type": "web_search"}]}, "built-in tool 'web_search' is not supported"),
        ({"tools": [{"type": "function", "name": "f g"}]}, "'body.tools[0].name'"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "not in tools"),
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "4"}]}, "no function_call before it"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input items must be messages, function_call"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "needs a name"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "an image URL must be"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "content[0].image_url: Field required"),
        ({"input": []}, "at least one message"),
        ({"reasoning": {"effort": "low"}}, "reasoning.effort='low' asks for thinking, but this model's chat template"),
        ({"reasoning": {"summary": "auto"}}, "'body.reasoning.summary'"),
        ({"reasoning": {"effort": "max"}}, "'body.reasoning.effort'"),
        ({"model": "gpt-4.1"}, "does not exist or is not served"),
        ({"max_output_tokens": 0}, "'body.max_output_tokens'"),
    ],
)
def test_what_needs_server_state_or_is_not_built_fails_its_line(body: dict[str, Any], message_part: str) -> None:
    error = rejected(validator().validate(responses_line(**body)))
    assert message_part in error.message, error


@pytest.mark.parametrize(
    ("text_format", "constraint"),
    [
        ({"type": "json_schema", "name": "x", "schema": {"type": "object"}}, {"json_schema": {"type": "object"}}),
        ({"type": "json_object"}, {"json_object": True}),
        ({"type": "text"}, None),
    ],
)
def test_text_format_constrains_the_output_as_chat_response_format(
    text_format: dict[str, Any], constraint: dict[str, Any] | None
) -> None:
    request = accepted(validator(max_model_len=512).validate(responses_line(text={"format": text_format})))
    structured = request.sampling_params.structured_output
    if constraint is None:
        assert structured is None
    else:
        assert structured is not None and {key: getattr(structured, key) for key in constraint} == constraint


@pytest.mark.parametrize(("finish_reason", "status"), [("stop", "completed"), ("length", "incomplete")])
def test_the_answer_is_a_response_object_the_sdk_parses(finish_reason: str, status: str) -> None:
    request = accepted(validator().validate(responses_line(instructions="be brief", max_output_tokens=3)))
    result = FakeResult([1, 5, 6, 7], [FakeSample(0, "the answer", [8, 9, 10], finish_reason)], num_cached_tokens=2)
    body = as_json(response_record(request, [result], model="smollm2", tokenizer=WordTokenizer()))["response"]["body"]
    response = Response.model_validate(body)
    assert (response.object, response.status, response.model) == ("response", status, "smollm2")
    assert response.output_text == "the answer"
    assert response.output[0].type == "message" and response.output[0].content[0].type == "output_text"
    assert (response.instructions, response.max_output_tokens) == ("be brief", 3)
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (4, 3, 7)
    assert response.usage.input_tokens_details.cached_tokens == 2
    if status == "incomplete":
        assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.incomplete_details is None


def test_function_tools_and_a_multi_turn_tool_conversation_read_as_chat_tool_calling() -> None:
    items = [
        {"role": "user", "content": "what is 2 + 2?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "adding"}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 2}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "4"},
    ]
    request = accepted(validator(max_model_len=2048).validate(
        responses_line(input=items, tools=TOOLS, tool_choice={"type": "function", "name": "add"}, parallel_tool_calls=False)
    ))
    as_chat = accepted(validator(max_model_len=2048).validate(chat_line(
        messages=[
            {"role": "user", "content": "what is 2 + 2?"},
            {"role": "assistant", "content": "adding", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        ],
        tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False,
    )))
    assert request.prompts == as_chat.prompts
    assert request.tool_calls == as_chat.tool_calls and request.tool_calls is not None
    assert request.sampling_params.structured_output == as_chat.sampling_params.structured_output  # the forced call
    plain = accepted(validator().validate(responses_line(tool_choice="auto", parallel_tool_calls=True)))
    assert plain.tool_calls is None and plain.sampling_params.structured_output is None  # no tools: text


@pytest.mark.parametrize("said", ["", "Let me add."])
def test_calls_come_back_as_function_call_items_the_sdk_parses(said: str) -> None:
    request = accepted(validator(max_model_len=2048).validate(responses_line(tools=TOOLS, tool_choice="required")))
    text = said + '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    result = FakeResult([1, 5], [FakeSample(0, text, [8, 9, 10], "stop")])
    body = as_json(response_record(request, [result], model="m", tokenizer=WordTokenizer()))["response"]["body"]
    response = Response.model_validate(body)
    assert response.status == "completed" and response.tool_choice == "required"
    assert [tool.name for tool in response.tools] == ["add"]  # type: ignore[union-attr]
    *message, call = response.output
    assert [item.content[0].text for item in message] == ([said] if said else [])  # type: ignore[union-attr]
    assert call.type == "function_call" and call.status == "completed" and call.call_id.startswith("call_")
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1, "b": 2})
