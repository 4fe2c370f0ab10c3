"""OpenAI's Responses API (`/v1/responses`) in batch lines: the request body, and the `response` object answering it.

A line's `input` (a string, or message items) and `instructions` become a chat conversation run like a chat
completions line; the answer is OpenAI's `response` object: one `message` output item holding `output_text`, a
`status` of "completed" or "incomplete" (`incomplete_details.reason` "max_output_tokens"), and `usage` in input and
output tokens. What needs state a batch service does not keep is refused per line: `previous_response_id` (no stored
responses to continue), `store: true` (nothing is kept for retrieval by id: the output file holds the responses),
`background` (a batch line is background work already), built-in tools. Function tools and `text.format`
json_schema wait for the structured-outputs work and are refused until it lands.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, field_validator, model_validator

from engine.structured_output import StructuredOutputParams
from jobs.openai_format.requests import ChatMessage, NotStreamed, ServiceTier, StrictBody
from jobs.openai_format.structured_output import ResponseFormat, constraint_from_request


def _input_text(content: object) -> object:
    """A message item's content: a string, or typed parts of which only text ones (`input_text`, or `output_text` in
    an earlier assistant turn) can reach a text-only model."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (
            isinstance(part, dict)
            and part.get("type") in ("input_text", "output_text")
            and isinstance(part.get("text"), str)
        ):
            raise ValueError('content parts must be {"type": "input_text", "text": "..."}; only text input is supported')
        texts.append(part["text"])
    return "\n".join(texts)


def _as_messages(value: object) -> object:
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


class InputMessage(StrictBody):
    """An `input` item: a message (OpenAI's EasyInputMessage, or an item with "type": "message")."""

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_input_text)]


class TextFormat(StrictBody):
    """The Responses API's output format: chat's response_format with the json_schema fields inline."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema: the schema's name
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output is constrained either way
    description: str | None = None

    @model_validator(mode="after")
    def _named_schema(self) -> "TextFormat":
        if self.type == "json_schema" and self.name is None:
            raise ValueError("text.format json_schema needs a name")
        return self

    def response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        inline = self.model_dump(include={"name", "schema_", "strict", "description"}, by_alias=True, exclude_none=True)
        return ResponseFormat.model_validate({"type": "json_schema", "json_schema": inline})


class TextConfig(StrictBody):
    format: TextFormat | None = None


def _no_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    for tool in tools or []:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(f"built-in tool {kind!r} is not supported: this service runs the model alone")
        raise ValueError("function tools are not supported yet in /v1/responses lines")
    return tools


def _refuse_if_set(message: str) -> Any:
    def check(value: object) -> object:
        if value:
            raise ValueError(message)
        return value

    return AfterValidator(check)


class ResponsesBody(StrictBody):
    model: str | None = None  # as for the other endpoints: a served model's name or alias
    input: Annotated[list[InputMessage], BeforeValidator(_as_messages)]  # a string is one user message
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: Annotated[list[dict[str, Any]] | None, AfterValidator(_no_tools)] = None
    tool_choice: Literal["none", "auto"] | None = None  # without tools, both mean: answer in text
    parallel_tool_calls: bool | None = None  # no tools, so nothing to call in parallel
    stream: NotStreamed = None
    # Accepted no-ops, as on chat completions: `metadata` tags the response, `user` names the end user,
    # `service_tier` picks OpenAI's processing tier.
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: str | None = None
    service_tier: ServiceTier | None = None
    truncation: Literal["disabled"] | None = None  # "disabled" (the default): a prompt too long fails its line
    store: Annotated[
        bool | None,
        _refuse_if_set(
            "store=true is not supported: responses are not kept for retrieval by id; the batch's output file holds "
            "them (send store: false or leave it out)"
        ),
    ] = None
    previous_response_id: Annotated[
        str | None,
        _refuse_if_set("previous_response_id is not supported: no response is stored to continue; send the whole "
                       "conversation as input items"),
    ] = None
    background: Annotated[
        bool | None, _refuse_if_set("background=true is not supported: a batch line already runs in the background")
    ] = None

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value: list[InputMessage]) -> list[InputMessage]:
        if not value:
            raise ValueError("input must hold at least one message")
        return value

    def constraint(self) -> StructuredOutputParams | None:
        text_format = self.text.format if self.text is not None else None
        return constraint_from_request(text_format.response_format() if text_format is not None else None)

    def messages(self) -> list[ChatMessage]:
        """The conversation the model is prompted with: the instructions as a system message, then the input."""
        turns = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        return [*turns, *(ChatMessage(role=item.role, content=item.content) for item in self.input)]

    def echoed(self) -> dict[str, Any]:
        """What the response object repeats of its request."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "metadata": self.metadata or {},
            "user": self.user,
            "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
            "tool_choice": self.tool_choice or "auto",
        }


# ---------------------------------------------------------------------------------------------------------
# The answer


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class InputTokensDetails(BaseModel):
    cached_tokens: int  # read from the engine's prefix cache
    cache_write_tokens: int = 0  # OpenAI reports prompt-cache writes it bills; this cache fills as it goes, unbilled


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseTextFormat(BaseModel):
    format: dict[str, str] = Field(default_factory=lambda: {"type": "text"})


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    tool_choice: Literal["none", "auto"]
    tools: list[Any] = Field(default_factory=list)
    text: ResponseTextFormat = Field(default_factory=ResponseTextFormat)
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage


def response_object(
    *, text: str, finish_reason: str, model: str, echoed: dict[str, Any], input_tokens: int, output_tokens: int,
    cached_tokens: int,
) -> ResponseObject:
    """The answer to one /v1/responses line from its one sample: cut by its token limit, it is "incomplete"."""
    complete = finish_reason == "stop"
    return ResponseObject(
        id="resp_" + uuid.uuid4().hex,
        created_at=int(time.time()),
        status="completed" if complete else "incomplete",
        incomplete_details=None if complete else IncompleteDetails(reason="max_output_tokens"),
        model=model,
        output=[
            OutputMessage(
                id="msg_" + uuid.uuid4().hex,
                status="completed" if complete else "incomplete",
                content=[OutputText(text=text)],
            )
        ],
        usage=ResponseUsage(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens,
            output_tokens_details=OutputTokensDetails(),
            total_tokens=input_tokens + output_tokens,
        ),
        **echoed,
    )
