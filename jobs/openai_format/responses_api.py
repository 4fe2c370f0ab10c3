"""OpenAI's Responses API (`/v1/responses`) in batch lines: the request body, and the `response` object answering it.

A line's `input` (a string, or items) and `instructions` become a chat conversation run like a chat completions
line: message items are turns, `function_call` items the assistant's earlier calls and `function_call_output` items
their results (tool turns), so a multi-turn tool conversation can be sent whole. Function `tools` and `tool_choice`
go through chat's tool-calling machinery (tool_calls.py). The answer is OpenAI's `response` object: a `message` output
item holding `output_text` and/or one `function_call` item per call the model made, a `status` of "completed" or
"incomplete" (`incomplete_details.reason` "max_output_tokens"), and `usage` in input and output tokens. What needs
state a batch service does not keep is refused per line: `previous_response_id` (no stored responses to continue),
`store: true` (nothing is kept for retrieval by id: the output file holds the responses), `background` (a batch
line is background work already), built-in tools (web search and the like: the model runs alone here).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    field_validator,
    model_validator,
)

from engine.structured_output import StructuredOutputParams
from jobs.openai_format.reasoning import ReasoningEffort, ThinkingAsked, effort_asks
from jobs.openai_format.responses import AnswerBody, TokenCounts
from jobs.images.inputs import Detail, check_image_url
from jobs.openai_format.requests import (
    ChatMessage,
    ContentPart,
    ImagePart,
    ImageUrl,
    NotStreamed,
    ServiceTier,
    StrictBody,
    TextPart,
    read_part,
)
from jobs.openai_format.structured_output import ResponseFormat, constraint_from_request
from jobs.openai_format.tool_calls import (
    FUNCTION_NAME_PATTERN,
    ChatFunctionCall,
    ChatToolCall,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolChoice,
)


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
            raise ValueError(
                'content parts must be {"type": "input_text", "text": "..."} or {"type": "input_image", "image_url": '
                '"...", "detail": "auto|low|high"}'
            )
        texts.append(part["text"])
    return "\n".join(texts)


class InputTextPart(StrictBody):
    type: Literal["input_text", "output_text"]  # output_text: an earlier assistant turn sent back
    text: str


class InputImagePart(StrictBody):
    type: Literal["input_image"]
    image_url: Annotated[str, AfterValidator(check_image_url)]  # a file_id is refused: files hold batch input here
    detail: Detail = "auto"

    def chat_part(self) -> ImagePart:
        return ImagePart(type="image_url", image_url=ImageUrl(url=self.image_url, detail=self.detail))


InputPart = Annotated[InputTextPart | InputImagePart, Field(discriminator="type")]


_INPUT_PART: TypeAdapter[InputTextPart | InputImagePart] = TypeAdapter(InputPart)


def _input_parts(content: object) -> object:
    """A message item's content: a string, or typed parts; text parts alone are joined into one text."""
    if not isinstance(content, list):
        return content
    if not any(isinstance(part, dict) and part.get("type") == "input_image" for part in content):
        return _input_text(content)
    return [read_part(_INPUT_PART, index, part) for index, part in enumerate(content)]


def _chat_content(content: str | list[InputPart]) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    return [
        part.chat_part() if isinstance(part, InputImagePart) else TextPart(type="text", text=part.text)
        for part in content
    ]


def _as_messages(value: object) -> object:
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


class InputMessage(StrictBody):
    """An `input` item: a message (OpenAI's EasyInputMessage, or an item with "type": "message")."""

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str | list[InputPart], BeforeValidator(_input_parts)]
    id: str | None = None  # an earlier response's output item sent back: its id and status change nothing
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @model_validator(mode="after")
    def _images_from_the_user(self) -> "InputMessage":
        if self.role != "user" and isinstance(self.content, list):
            if any(isinstance(part, InputImagePart) for part in self.content):
                raise ValueError("only user messages carry images")
        return self


class FunctionCallItem(StrictBody):
    """An `input` item: a call the model made in an earlier turn (the `function_call` output item, sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictBody):
    """An `input` item: the result of an earlier call, for the model to read (a tool turn)."""

    type: Literal["function_call_output"]
    call_id: str  # the `function_call` it answers
    output: Annotated[str, BeforeValidator(_input_text)]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(item: object) -> str | None:
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return kind or "message"  # OpenAI's EasyInputMessage has no type


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_input_item",
        custom_error_message="input items must be messages, function_call or function_call_output items "
        "(reasoning, item references and built-in tools' items are not supported)",
    ),
]


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


class FunctionTool(StrictBody):
    """A Responses API function tool: chat's function definition, inline."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> Tool:
        definition = self.model_dump(exclude={"type"}, exclude_none=True)
        return Tool(type="function", function=FunctionDefinition.model_validate(definition))


def _function_tools_only(tools: object) -> object:
    for tool in tools if isinstance(tools, list) else []:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(f"built-in tool {kind!r} is not supported: this service runs the model alone")
    return tools


class FunctionToolChoice(StrictBody):
    type: Literal["function"]
    name: str


def _refuse_if_set(message: str) -> Any:
    def check(value: object) -> object:
        if value:
            raise ValueError(message)
        return value

    return AfterValidator(check)


class ReasoningConfig(StrictBody):
    """The Responses API's `reasoning`: its effort switches a thinking template (`reasoning.thinking_variables`); a
    `summary` is refused (no summarizer here: the whole thinking comes back in the reasoning item)."""

    effort: ReasoningEffort | None = None


class ResponsesBody(StrictBody):
    model: str | None = None  # as for the other endpoints: a served model's name or alias
    input: Annotated[list[InputItem], BeforeValidator(_as_messages)]  # a string is one user message
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], BeforeValidator(_function_tools_only)] | None = None
    # As on chat; without tools "none" and "auto" both mean: answer in text.
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None  # as on chat; without tools, nothing to call
    stream: NotStreamed = None
    reasoning: ReasoningConfig | None = None
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
    def _non_empty(cls, value: list[InputItem]) -> list[InputItem]:
        if not value:
            raise ValueError("input must hold at least one message")
        calls: set[str] = set()
        for item in value:  # as OpenAI: a result must answer a call made before it
            if isinstance(item, FunctionCallItem):
                calls.add(item.call_id)
            elif isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
                raise ValueError(f"no function_call before it has call_id {item.call_id!r}")
        return value

    def chat_tools(self) -> list[Tool] | None:
        return [tool.as_chat_tool() for tool in self.tools] if self.tools else None

    def chat_tool_choice(self) -> ToolChoice | None:
        """tool_choice for chat's planning. Without tools, "auto" means what "none" does (OpenAI accepts it there)."""
        if isinstance(self.tool_choice, FunctionToolChoice):
            return NamedToolChoice(type="function", function=FunctionName(name=self.tool_choice.name))
        return None if not self.tools and self.tool_choice == "auto" else self.tool_choice

    def constraint(self) -> StructuredOutputParams | None:
        text_format = self.text.format if self.text is not None else None
        return constraint_from_request(text_format.response_format() if text_format is not None else None)

    def thinking_asked(self) -> ThinkingAsked | None:
        return effort_asks(self.reasoning.effort if self.reasoning is not None else None, "reasoning.effort")

    def messages(self) -> list[ChatMessage]:
        """The conversation the model is prompted with: the instructions as a system message, then the input. A
        function call joins the assistant turn before it (its text, then its calls, as chat writes one turn)."""
        turns = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        for item in self.input:
            if isinstance(item, FunctionCallItem):
                call = ChatToolCall(
                    id=item.call_id, type="function", function=ChatFunctionCall(name=item.name, arguments=item.arguments)
                )
                if turns and turns[-1].role == "assistant":
                    turns[-1] = turns[-1].model_copy(update={"tool_calls": [*(turns[-1].tool_calls or []), call]})
                else:
                    turns.append(ChatMessage(role="assistant", tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputItem):
                turns.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
            else:
                turns.append(ChatMessage(role=item.role, content=_chat_content(item.content)))
        return turns

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
            "tool_choice": (
                self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionToolChoice) else self.tool_choice
            )
            or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or []],
            "reasoning": self.reasoning.model_dump() if self.reasoning is not None else None,
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


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The thinking of a model that thinks (jobs.openai_format.reasoning), before the answer's items."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)  # no summarizer here: the whole thinking is in content
    content: list[ReasoningText]


class OutputFunctionCall(BaseModel):
    """A call the model made: the client runs it and sends the result back as a `function_call_output` item."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: Literal["completed"] = "completed"


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


class ResponseObject(AnswerBody):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputReasoning | OutputMessage | OutputFunctionCall]
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    tool_choice: Literal["none", "auto", "required"] | dict[str, str]
    tools: list[dict[str, Any]]
    text: ResponseTextFormat = Field(default_factory=ResponseTextFormat)
    reasoning: ReasoningConfig | None = None  # the request's, repeated
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage

    def token_counts(self) -> TokenCounts:
        return TokenCounts(self.usage.input_tokens, self.usage.output_tokens, self.usage.input_tokens_details.cached_tokens)


def response_object(
    *, text: str | None, calls: list[ToolCall], finish_reason: str, model: str, echoed: dict[str, Any],
    input_tokens: int, output_tokens: int, cached_tokens: int, reasoning: str | None = None, reasoning_tokens: int = 0,
) -> ResponseObject:
    """The answer to one /v1/responses line from its one sample, its text and the calls found in it (tool_calls.py):
    a reasoning item with the thinking of a model that thinks, a message with the text (when there is any, or when
    there are no calls), then a function_call item per call. Cut by its token limit, it is "incomplete"."""
    complete = finish_reason == "stop"
    status: Literal["completed", "incomplete"] = "completed" if complete else "incomplete"
    output: list[OutputReasoning | OutputMessage | OutputFunctionCall] = []
    if reasoning is not None:
        output.append(OutputReasoning(id="rs_" + uuid.uuid4().hex, content=[ReasoningText(text=reasoning)]))
    if text or not calls:
        output.append(OutputMessage(id="msg_" + uuid.uuid4().hex, status=status, content=[OutputText(text=text or "")]))
    output += [
        OutputFunctionCall(
            id="fc_" + uuid.uuid4().hex, call_id=call.id, name=call.function.name, arguments=call.function.arguments
        )
        for call in calls
    ]
    return ResponseObject(
        id="resp_" + uuid.uuid4().hex,
        created_at=int(time.time()),
        status=status,
        incomplete_details=None if complete else IncompleteDetails(reason="max_output_tokens"),
        model=model,
        output=output,
        usage=ResponseUsage(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=input_tokens + output_tokens,
        ),
        **echoed,
    )
