"""The Anthropic Messages format (`jobs.formats.anthropic_messages`) on its own: a Message Batch request's params
read into a chat conversation and engine request, and the engine's result written as Anthropic's `message`."""

from __future__ import annotations

import json
from typing import Any

from jobs.formats.anthropic_messages import MESSAGES
from jobs.openai_format.records import response_record
from jobs.openai_format.requests import BatchRequest
from jobs.openai_format.validation import BatchLineValidator, LineError
from jobs.run.kinds import TokenUsage
from jobs.run.openai_lines import line_usage
from tests.jobs.test_openai_format import SERVED, FakeResult, FakeSample, WordTokenizer, as_json

WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


class RecordingTokenizer(WordTokenizer):
    """Remembers the conversation the chat template was given."""

    def __init__(self) -> None:
        self.conversations: list[list[dict[str, Any]]] = []

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **_: Any) -> str:
        self.conversations.append(messages)
        return " ".join(str(message.get("content")) for message in messages)


def line(custom_id: str = "m", **params: Any) -> str:
    body = {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "hello there"}], **params}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": MESSAGES, "body": body})


def read(text: str, tokenizer: WordTokenizer | None = None) -> BatchRequest:
    checked = BatchLineValidator(tokenizer or WordTokenizer(), 512, models=SERVED).validate(text)
    assert isinstance(checked, BatchRequest), checked
    return checked


def answer(request: BatchRequest, sample: FakeSample, cached: int = 0) -> dict[str, Any]:
    record = response_record(request, [FakeResult([1, 2, 3, 4], [sample], cached)], model="smollm2", tokenizer=WordTokenizer())
    return as_json(record)["response"]["body"]


def test_system_blocks_tool_uses_and_tool_results_become_the_chat_conversation() -> None:
    tokenizer = RecordingTokenizer()
    read(
        line(
            system=[{"type": "text", "text": "Be terse."}, {"type": "text", "text": "Use tools."}],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Oslo?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Snow"}]},
            ],
            tools=[WEATHER],
            tool_choice={"type": "none"},
        ),
        tokenizer,
    )
    # A template without a tool format gets chat's generic one (Hermes' syntax), as a chat line's calls and results do
    (conversation,) = tokenizer.conversations
    assert [turn["role"] for turn in conversation] == ["system", "user", "assistant", "user"]
    assert conversation[0]["content"] == "Be terse.\nUse tools." and conversation[1]["content"] == "Weather\nin Oslo?"
    assert conversation[2]["content"] == (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert conversation[3]["content"] == "<tool_response>\nSnow\n</tool_response>"


def test_sampling_parameters_and_stop_sequences_reach_the_engine() -> None:
    params = read(line(temperature=0.2, top_p=0.9, top_k=5, stop_sequences=["END"], max_tokens=6)).sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.stop, params.max_tokens) == (0.2, 0.9, 5, ["END"], 6)


def test_stop_reasons_and_usage_are_anthropics() -> None:
    request = read(line(stop_sequences=["END"]))
    stopped = answer(request, FakeSample(0, "red", [7], "stop", stop_reason="END"), cached=3)
    assert stopped["type"] == "message" and stopped["role"] == "assistant" and stopped["id"].startswith("msg_")
    assert stopped["content"] == [{"type": "text", "text": "red"}]
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    # Anthropic's input_tokens leave out what the cache read; the batch's usage counts the whole prompt
    assert stopped["usage"] == {
        "input_tokens": 1,
        "output_tokens": 1,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 3,
    }
    result = FakeResult([1, 2, 3, 4], [FakeSample(0, "red", [7], "stop")], 3)
    assert line_usage(response_record(request, [result], model="m", tokenizer=WordTokenizer())) == TokenUsage(4, 1, 3)
    assert answer(request, FakeSample(0, "red", [7], "stop", stop_reason=2))["stop_reason"] == "end_turn"  # EOS
    assert answer(request, FakeSample(0, "red", [7, 8], "length"))["stop_reason"] == "max_tokens"


def test_a_tool_call_is_a_tool_use_block() -> None:
    request = read(line(tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=64))
    assert request.tool_calls is not None and not request.tool_calls.parallel
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    body = answer(request, FakeSample(0, call, [7] * 12, "stop"))
    assert body["stop_reason"] == "tool_use"
    (block,) = body["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    assert (block["name"], block["input"]) == ("get_weather", {"city": "Oslo"})


def test_what_cannot_run_is_refused_by_name() -> None:
    refusals = {
        "image": line(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
        "tool_use blocks belong to assistant messages": line(
            messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "w", "input": {}}]}]
        ),
        'name is required with type "tool"': line(tools=[WEATHER], tool_choice={"type": "tool"}),
        "tool_choice needs tools": line(tool_choice={"type": "any"}),
        "thinking.type='enabled' asks for thinking, but this model's chat template does not think": line(
            thinking={"type": "enabled"}
        ),
        "thinking.budget_tokens=4 is not supported below max_tokens (8)": line(
            thinking={"type": "enabled", "budget_tokens": 4}
        ),
        'budget_tokens goes with type "enabled" only': line(thinking={"type": "disabled", "budget_tokens": 8}),
        "missing required parameter 'body.max_tokens'": json.dumps(
            {"custom_id": "m", "method": "POST", "url": MESSAGES, "body": {"model": "smollm2", "messages": []}}
        ),
    }
    for words, text in refusals.items():
        checked = BatchLineValidator(WordTokenizer(), 512, models=SERVED).validate(text)
        assert isinstance(checked, LineError) and words in checked.message, (words, checked)
