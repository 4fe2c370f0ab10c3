"""Tool calls: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls` → a prompt, an output constraint, and
back from the generated text to `message.tool_calls`.

The call syntax is the chat template's own where it has one of the families `tool_syntax.py` reads (Hermes/Qwen,
Llama 3.1+ JSON, Mistral), else Hermes' in conveyor's generic format.

- A template with its own syntax gets the tools as Hugging Face's `apply_chat_template(..., tools=...)` passes them,
  and the conversation's assistant `tool_calls` and `role: "tool"` results as they are (arguments parsed from their
  JSON string, as the templates expect an object; for Mistral, call ids other than 9 letters or digits replaced by 9
  hex digits of their hash, since its templates refuse them).
- Any other template (SmolLM2's has no tool format) gets the generic format: a system message listing the tools' JSON
  and the call format `<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>`
  (appended to the conversation's own system message when there is one), assistant tool calls written as
  `<tool_call>` blocks, and tool results as user turns wrapped in `<tool_response>` tags.

Constraints (xgrammar structural tags in the template's syntax, so arguments always validate against the function's
schema): `required` → one or more calls and nothing else (one when `parallel_tool_calls` is false, or the syntax
carries one call a turn, as Llama's); a named function → exactly one call to it; `auto` → free text, but once the
model opens a call (the syntax's trigger) the call is constrained; `none` → no tools in the prompt and no constraint.
Generated text that holds no well-formed call is the answer's content, as written (`CallSyntax.parse`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.structured_output import StructuredOutputParams
from jobs.openai_format.structured_output import ConstraintRejected, check_json_schema
from jobs.openai_format.tool_syntax import HERMES, CallSyntax

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
    """What answering a tool-enabled line needs: which calls to look for in the generated text, in which syntax."""

    function_names: tuple[str, ...]
    parallel: bool
    syntax: CallSyntax


def plan_tool_calls(
    tools: Sequence[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None, syntax: CallSyntax
) -> tuple[ToolCallPlan | None, StructuredOutputParams | None]:
    """The plan (None when tools are off) and the constraint in `syntax` (None for `none`, or no tools)."""
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
    # OpenAI's default is true; a syntax with one call a turn (Llama's) gives at most one either way
    parallel = parallel_tool_calls is not False and syntax.parallel
    tags = {name: syntax.call_tag(name, schema) for name, schema in schemas.items()}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in tags:
            raise ConstraintRejected("invalid_parameter", f"tool_choice names function {name!r}, which is not in tools {names}")
        return ToolCallPlan((name,), False, syntax), _structural_tag(syntax.calls([tags[name]], parallel=False))
    if choice == "required":
        calls = syntax.calls(list(tags.values()), parallel)
    else:
        calls = syntax.optional_calls(list(tags.values()), parallel)
    return ToolCallPlan(tuple(names), parallel, syntax), _structural_tag(calls)


def _structural_tag(format_: dict[str, Any]) -> StructuredOutputParams:
    return StructuredOutputParams(structural_tag={"type": "structural_tag", "format": format_})


def template_messages(messages: Sequence[dict[str, Any]], syntax: CallSyntax | None) -> list[dict[str, Any]]:
    """OpenAI messages (plain dicts) → what the chat template is given. With the template's own `syntax`, assistant
    calls carry their arguments as objects; in the generic format (None) calls and results become text."""
    rendered = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if message["role"] == "tool":
            if syntax is None:
                message = {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
            elif "tool_call_id" in message:
                message["tool_call_id"] = syntax.template_call_id(message["tool_call_id"])
        elif calls:
            if syntax is not None:
                message["tool_calls"] = [
                    {"id": syntax.template_call_id(call["id"]), "type": "function",
                     "function": {"name": call["function"]["name"], "arguments": _arguments(call)}}
                    for call in calls
                ]
            else:
                blocks = HERMES.calls_text([(call["function"]["name"], _arguments(call)) for call in calls])
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
        f'{HERMES.call_prefix}{{"name": <function name>, "arguments": <arguments as a JSON object>}}{HERMES.call_suffix}\n'
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


def parse_tool_calls(text: str, plan: ToolCallPlan) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from the generated text: every well-formed call, in the plan's syntax, of one of the plan's
    functions becomes a call; the text around the calls is the content (None when there is none). Text without such
    calls comes back whole, with no calls."""
    content, found = plan.syntax.parse(text, plan.function_names)
    calls = [
        ToolCall(
            id=f"call_{uuid.uuid4().hex[:24]}",
            function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)),
        )
        for name, arguments in found
    ]
    return content, calls
