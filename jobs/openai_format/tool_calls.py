"""Tool calls: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls` → a prompt, an output constraint, and
back from the generated text to `message.tool_calls`.

The call format is Hermes' (Qwen 2.5/3, Hermes, and conveyor's generic format alike): each call is
`<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>`.

- A chat template that renders `tools` in that format (its source mentions `<tool_call>`) gets the tools
  as Hugging Face's `apply_chat_template(..., tools=...)` passes them, and the conversation's assistant
  `tool_calls` and `role: "tool"` results as they are (arguments parsed from their JSON string, as the
  templates expect an object).
- Any other template (SmolLM2's has no tool format) gets the generic format: a system message listing the
  tools' JSON and the call format above (appended to the conversation's own system message when there is
  one), assistant tool calls written as `<tool_call>` blocks, and tool results as user turns wrapped in
  `<tool_response>` tags.

Constraints (xgrammar structural tags, so arguments always validate against the function's schema):
`required` → one or more calls and nothing else (one when `parallel_tool_calls` is false); a named function →
exactly one call to it; `auto` → free text, but once the model opens `<tool_call>` the call is constrained;
`none` → no tools in the prompt and no constraint. Llama 3.1's and Mistral's own call formats are not
parsed: their templates get the generic format.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.structured_output import StructuredOutputParams
from jobs.openai_format.structured_output import ConstraintRejected, check_json_schema

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls are constrained whenever tool_choice forces them, strict or not


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatFunctionCall(_Strict):
    """An assistant turn's earlier call, in the input."""

    name: str
    arguments: str


class ChatToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: ChatFunctionCall


@dataclass(frozen=True)
class ToolCallPlan:
    """What answering a tool-enabled line needs: which calls to look for in the generated text."""

    function_names: tuple[str, ...]
    parallel: bool


def plan_tool_calls(
    tools: Sequence[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None
) -> tuple[ToolCallPlan | None, StructuredOutputParams | None]:
    """The plan (None when tools are off) and the constraint (None for `none`, or no tools)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ConstraintRejected("invalid_parameter", "tool_choice needs tools")
        if parallel_tool_calls is not None:
            raise ConstraintRejected("invalid_parameter", "parallel_tool_calls needs tools")
        return None, None
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise ConstraintRejected("invalid_parameter", f"tools have repeated function names: {names}")
    schemas = {
        tool.function.name: check_json_schema(
            tool.function.parameters if tool.function.parameters is not None else _EMPTY_PARAMETERS,
            f"tools[{index}].function.parameters",
        )
        for index, tool in enumerate(tools)
    }
    choice = tool_choice or "auto"  # OpenAI's default when tools are present
    if choice == "none":
        return None, None
    parallel = parallel_tool_calls is not False  # OpenAI's default: true
    tags = {name: _call_tag(name, schema) for name, schema in schemas.items()}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in tags:
            raise ConstraintRejected("invalid_parameter", f"tool_choice names function {name!r}, which is not in tools {names}")
        return ToolCallPlan((name,), parallel=False), _structural_tag(tags[name])
    if choice == "required":
        calls = {"type": "tags_with_separator", "tags": list(tags.values()), "separator": "\n",
                 "at_least_one": True, "stop_after_first": not parallel}
    else:
        calls = {"type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": list(tags.values()),
                 "at_least_one": False, "stop_after_first": not parallel}
    return ToolCallPlan(tuple(names), parallel), _structural_tag(calls)


def _call_tag(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": f'{CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": ',
        # one whitespace at most between tokens: a small model must not loop on newlines inside a call
        "content": {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": 1},
        "end": f"}}\n{CALL_END}",
    }


def _structural_tag(format_: dict[str, Any]) -> StructuredOutputParams:
    return StructuredOutputParams(structural_tag={"type": "structural_tag", "format": format_})


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the model's own template writes tools in the Hermes format this module parses."""
    return chat_template is not None and "tools" in chat_template and CALL_BEGIN in chat_template


def template_messages(messages: Sequence[dict[str, Any]], native: bool) -> list[dict[str, Any]]:
    """OpenAI messages (plain dicts) → what the chat template is given. Natively, assistant calls carry their
    arguments as objects; in the generic format calls and results become text."""
    rendered = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if message["role"] == "tool":
            if not native:
                message = {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        elif calls:
            if native:
                message["tool_calls"] = [
                    {"id": call["id"], "type": "function",
                     "function": {"name": call["function"]["name"], "arguments": _arguments(call)}}
                    for call in calls
                ]
            else:
                blocks = "\n".join(_call_text(call["function"]["name"], _arguments(call)) for call in calls)
                message["content"] = f"{message.get('content') or ''}\n{blocks}".lstrip("\n")
        rendered.append(message)
    return rendered


def generic_tool_prompt(messages: list[dict[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The generic format's instructions, in the system message."""
    listing = "\n".join(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False) for tool in tools)
    instructions = (
        "You can call these functions (each given as JSON, with a JSON Schema of its parameters):\n"
        f"{listing}\n"
        "To call a function, answer with one block per call, exactly:\n"
        f'{CALL_BEGIN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CALL_END}\n'
        "Otherwise answer normally."
    )
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{instructions}"}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def _arguments(call: dict[str, Any]) -> Any:
    try:
        return json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        raise ConstraintRejected(
            "invalid_parameter", f"tool call {call['id']!r} has arguments that are not JSON: {call['function']['arguments']!r}"
        ) from None


def _call_text(name: str, arguments: Any) -> str:
    return f'{CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n{CALL_END}'


def parse_tool_calls(text: str, plan: ToolCallPlan) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from the generated text: every complete `<tool_call>` block naming one of the plan's
    functions with an object of arguments becomes a call; the text around the calls is the content (None
    when there is none). Text without such blocks comes back whole, with no calls."""
    calls: list[ToolCall] = []
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(call, dict) and call.get("name") in plan.function_names and isinstance(call.get("arguments"), dict)):
            continue
        calls.append(
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=FunctionCall(name=call["name"], arguments=json.dumps(call["arguments"], ensure_ascii=False)),
            )
        )
    if not calls:
        return text, []
    content = _CALL.sub("", text).strip()
    return content or None, calls
