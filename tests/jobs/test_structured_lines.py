"""Batch lines with output constraints, logit_bias and tools: what validation accepts, and each bad line's own
error (no model: the word tokenizer of test_openai_format)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.structured_output import StructuredOutputParams
from jobs.openai_format.records import response_record
from jobs.openai_format.requests import BatchRequest
from jobs.openai_format.validation import LineError
from tests.jobs.test_openai_format import FakeResult, FakeSample, chat_line, completion_line, validator

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


def check(line: str) -> BatchRequest | LineError:
    return validator(max_model_len=512).validate(line)


def constraint(line: str) -> StructuredOutputParams | None:
    request = check(line)
    assert isinstance(request, BatchRequest), request
    return request.sampling_params.structured_output


def json_schema_format(schema: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True, **extra}}


def test_response_formats_become_constraints():
    assert constraint(chat_line(response_format={"type": "text"})) is None
    assert constraint(chat_line(response_format={"type": "json_object"})) == StructuredOutputParams(json_object=True)
    assert constraint(chat_line(response_format=json_schema_format(PERSON))) == StructuredOutputParams(json_schema=PERSON)
    assert constraint(completion_line(response_format=json_schema_format(PERSON))) == StructuredOutputParams(
        json_schema=PERSON
    )


def test_guided_extras_become_constraints():
    assert constraint(completion_line(guided_choice=["yes", "no"])) == StructuredOutputParams(choice=("yes", "no"))
    assert constraint(completion_line(guided_regex="[0-9]+")) == StructuredOutputParams(regex="[0-9]+")
    assert constraint(completion_line(guided_json=json.dumps(PERSON))) == StructuredOutputParams(json_schema=PERSON)
    assert constraint(chat_line(guided_json=PERSON)) == StructuredOutputParams(json_schema=PERSON)
    assert constraint(completion_line(guided_grammar='root ::= "a"')) == StructuredOutputParams(grammar='root ::= "a"')


@pytest.mark.parametrize(
    "body, code, message",
    [
        ({"response_format": json_schema_format({"type": "objekt"})}, "invalid_json_schema", "is not valid JSON Schema"),
        ({"response_format": json_schema_format({"type": "object", "required": "name"})}, "invalid_json_schema",
         "['required']"),
        ({"response_format": json_schema_format([1])}, "invalid_body", "'body.response_format.json_schema.schema'"),
        ({"response_format": {"type": "json_schema"}}, "invalid_parameter", "needs json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "invalid_body", "'body.response_format.type'"),
        ({"response_format": json_schema_format(PERSON, extra=1)}, "invalid_body", "unsupported parameter"),
        ({"response_format": json_schema_format({"type": "array", "uniqueItems": True})}, "unsupported_json_schema",
         "'uniqueItems'"),
        ({"response_format": json_schema_format({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})},
         "unsupported_json_schema", "schema.properties.a uses 'not'"),
        ({"response_format": json_schema_format({"oneOf": [{"type": "string"}, {"type": "integer"}]})},
         "unsupported_json_schema", "'oneOf'"),
        ({"response_format": json_schema_format({"type": "string", "format": "credit-card"})}, "unsupported_json_schema",
         "format 'credit-card'"),
        ({"guided_json": "{nope"}, "invalid_json_schema", "not JSON"),
        ({"guided_choice": []}, "invalid_parameter", "choice must be a non-empty list"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "invalid_parameter", "at most one output constraint"),
        ({"logit_bias": {"5": 101}}, "invalid_parameter", "[-100, 100]"),
        ({"logit_bias": {"abc": 1}}, "invalid_parameter", "token ids"),
        ({"logit_bias": {"5000": 1}}, "invalid_parameter", "outside the vocabulary"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "invalid_parameter", "ignore_eos"),
        ({"response_format": {"type": "json_object"}, "use_beam_search": True, "n": 2, "temperature": 0},
         "invalid_parameter", "beam search"),
        # tools
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "invalid_parameter", "names function 'get_time', which is not in tools"),
        ({"tool_choice": "required"}, "invalid_parameter", "tool_choice needs tools"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "invalid_parameter", "repeated function names"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
         "invalid_json_schema", "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"allOf": []}}}]},
         "invalid_json_schema", "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"if": {}}}}]},
         "unsupported_json_schema", "'if'"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "invalid_body", "function.name"),
        ({"tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}}, "invalid_parameter", "cannot be combined"),
    ],
)
def test_bad_constraints_fail_their_own_line(body, code, message):
    result = check(chat_line("bad", **body))
    assert isinstance(result, LineError), result
    assert (result.custom_id, result.code) == ("bad", code)
    assert message in result.message


def test_logit_bias_is_passed_as_token_ids():
    request = check(completion_line(logit_bias={"12": -100, "40": 5.5}))
    assert isinstance(request, BatchRequest)
    assert request.sampling_params.logit_bias == {12: -100.0, 40: 5.5}


def test_tool_choices_become_structural_tags():
    required = check(chat_line(tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False))
    assert isinstance(required, BatchRequest) and required.tool_calls is not None
    tag = required.sampling_params.structured_output.structural_tag["format"]
    assert tag["type"] == "tag"  # one function, one call: exactly that call
    several = check(chat_line(tools=[WEATHER_TOOL], tool_choice="required"))
    tags = several.sampling_params.structured_output.structural_tag["format"]
    assert tags["type"] == "tags_with_separator" and tags["at_least_one"] and not tags["stop_after_first"]
    named = check(chat_line(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.sampling_params.structured_output.structural_tag["format"]["begin"].endswith(
        '{"name": "get_weather", "arguments": '
    )
    auto = check(chat_line(tools=[WEATHER_TOOL]))
    assert auto.sampling_params.structured_output.structural_tag["format"]["type"] == "triggered_tags"
    none = check(chat_line(tools=[WEATHER_TOOL], tool_choice="none"))
    assert none.sampling_params.structured_output is None and none.tool_calls is None


def test_conversations_with_tool_calls_and_results_are_accepted():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    request = check(chat_line(messages=messages, tools=[WEATHER_TOOL]))
    assert isinstance(request, BatchRequest), request
    bad = check(chat_line(messages=[messages[0], {**messages[1], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]))
    assert isinstance(bad, LineError) and "not JSON" in bad.message


def test_tool_calls_are_answered_as_openai_does():
    request = check(chat_line(tools=[WEATHER_TOOL], tool_choice="required"))
    assert isinstance(request, BatchRequest)
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>'
    )
    result = FakeResult([1, 2], [FakeSample(0, text, [5] * 30, "stop")])
    body = json.loads(response_record(request, [result], model="m", tokenizer=None).model_dump_json())["response"]["body"]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [call["function"]["name"] for call in calls] == ["get_weather", "get_weather"]
    assert [json.loads(call["function"]["arguments"]) for call in calls] == [
        {"city": "Paris", "unit": "C"}, {"city": "Rome", "unit": "C"}
    ]
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in calls)
    assert len({call["id"] for call in calls}) == 2


def test_an_answer_without_calls_is_plain_content():
    request = check(chat_line(tools=[WEATHER_TOOL]))
    result = FakeResult([1, 2], [FakeSample(0, "It is sunny.", [5, 6], "stop")])
    body = json.loads(response_record(request, [result], model="m", tokenizer=None).model_dump_json())["response"]["body"]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_a_constraint_the_engine_cannot_compile_fails_its_line():
    request = check(completion_line(guided_regex="(unclosed"))
    result = FakeResult([1, 2], [FakeSample(0, "", [], "abort")], error="cannot compile the regex constraint: ...")
    record = json.loads(response_record(request, [result], model="m", tokenizer=None).model_dump_json())
    assert record["error"]["code"] == "invalid_parameter" and "regex" in record["error"]["message"]
