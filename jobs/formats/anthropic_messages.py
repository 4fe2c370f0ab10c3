"""Anthropic's Messages API, `/v1/messages`, as the lines of a Message Batch: `params` in, a `message` out.

The conversation becomes a chat one, run like a chat completions line: `system` (a string or text blocks) the
system turn, text blocks joined, an assistant's `tool_use` blocks its tool calls and a user's `tool_result` blocks
tool turns, so a multi-turn tool conversation can be sent whole. `tools` (`input_schema`) and `tool_choice` (`auto`,
`any`, `tool`, `none`; `disable_parallel_tool_use`) go through chat's constrained tool calling (tool_calls.py). The
answer is Anthropic's `message`: a text block (when there is text, or no call), a `tool_use` block per call, a
`stop_reason` (`end_turn`, `max_tokens`, `stop_sequence` with the `stop_sequence` that ended it, `tool_use`) and
`usage`, whose `input_tokens` leave out what the prefix cache read (`cache_read_input_tokens`), as Anthropic counts.
`thinking` (`enabled` / `disabled`) switches a thinking template as OpenAI's `reasoning_effort` does
(`jobs.openai_format.reasoning.thinking_variables`); its `budget_tokens` is refused where it could bind.
`image` blocks (`source` base64 or url) are a chat line's image parts (`jobs.images`); document blocks and `stream`
are refused: every field is honoured or refused.
docs/anthropic_compatibility.md lists every field and what becomes of it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Discriminator, Field, Tag, model_validator

from jobs.formats.base import Generation, GenerationResult, LineReader, parse_body, read_sample
from jobs.images.inputs import check_image_url
from jobs.openai_format.reasoning import ThinkingAsked
from jobs.openai_format.requests import (
    BatchRequest,
    ChatMessage,
    ContentPart,
    ImagePart,
    ImageUrl,
    NotStreamed,
    PromptTokenizer,
    StrictBody,
    TextPart,
)
from jobs.openai_format.responses import AnswerBody, TokenCounts
from jobs.openai_format.tool_calls import (
    ChatFunctionCall,
    ChatToolCall,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    Tool,
    ToolChoice,
)
from jobs.served_models import ModelKind

MESSAGES = "/v1/messages"


def _refused(message: str) -> Any:
    def refuse(value: object) -> object:
        if value is not None:
            raise ValueError(message)
        return value

    return AfterValidator(refuse)


class CacheControl(StrictBody):
    """Anthropic's prompt-cache breakpoint: accepted and needless, the engine's prefix cache covers every prompt."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictBody):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Annotated[list[Any] | None, _refused("citations are not supported: there are no documents to cite")] = None


class ToolUseBlock(StrictBody):
    """A call the assistant made in an earlier turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(StrictBody):
    """The result of an earlier call, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[list[TextBlock], BeforeValidator(_as_blocks)] = []  # a string: one text block
    is_error: bool | None = None  # the template sees the text either way; an error reads as what it says
    cache_control: CacheControl | None = None

    def text(self) -> str:
        return "\n".join(block.text for block in self.content)


class Base64Source(StrictBody):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(StrictBody):
    type: Literal["url"]
    url: Annotated[str, AfterValidator(check_image_url)]


class ImageBlock(StrictBody):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def part(self) -> ImagePart:
        """The block as chat's image part (its URL checked as chat's are)."""
        source = self.source
        url = source.url if isinstance(source, UrlSource) else f"data:{source.media_type};base64,{source.data}"
        return ImagePart(type="image_url", image_url=ImageUrl(url=url))


_UNREAD_BLOCKS = ("document", "thinking", "redacted_thinking", "search_result", "server_tool_use")


def _as_blocks(content: object) -> object:
    """A string is one text block. Blocks a text-only model cannot take are refused by name, rather than by
    pydantic's list of type errors."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    for block in content if isinstance(content, list) else []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _UNREAD_BLOCKS:
            raise ValueError(f"{kind} blocks are not supported: this deployment's models read text and images only")
    return content


def _block_type(block: object) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return kind if isinstance(kind, str) else None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")],
    Discriminator(_block_type),
]


class Message(StrictBody):
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], BeforeValidator(_as_blocks)]  # a string: one text block

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> "Message":
        if self.role == "user" and any(isinstance(block, ToolUseBlock) for block in self.content):
            raise ValueError("tool_use blocks belong to assistant messages")
        if self.role == "assistant" and any(isinstance(block, ToolResultBlock) for block in self.content):
            raise ValueError("tool_result blocks belong to user messages")
        if self.role == "assistant" and any(isinstance(block, ImageBlock) for block in self.content):
            raise ValueError("image blocks belong to user messages")
        return self

    def chat_turns(self) -> list[ChatMessage]:
        """This message as chat turns: a user's tool results first (one tool turn each), then its text."""
        text = "\n".join(block.text for block in self.content if isinstance(block, TextBlock))
        calls = [
            ChatToolCall(
                id=block.id, type="function", function=ChatFunctionCall(name=block.name, arguments=json.dumps(block.input))
            )
            for block in self.content
            if isinstance(block, ToolUseBlock)
        ]
        turns = [
            ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=block.text())
            for block in self.content
            if isinstance(block, ToolResultBlock)
        ]
        if calls:
            turns.append(ChatMessage(role="assistant", content=text or None, tool_calls=calls))
        elif any(isinstance(block, ImageBlock) for block in self.content):  # its text and images, in order
            parts: list[ContentPart] = [
                TextPart(type="text", text=block.text) if isinstance(block, TextBlock) else block.part()
                for block in self.content
                if isinstance(block, (TextBlock, ImageBlock))
            ]
            turns.append(ChatMessage(role=self.role, content=parts))
        elif text or not turns:
            turns.append(ChatMessage(role=self.role, content=text))
        return turns


class ToolDefinition(StrictBody):
    type: Literal["custom"] | None = None  # Anthropic's client tools; its server tools (web search...) run nowhere here
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None

    def as_chat_tool(self) -> Tool:
        return Tool(
            type="function",
            function=FunctionDefinition(name=self.name, description=self.description, parameters=self.input_schema),
        )


class ToolChoiceParam(StrictBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool | None = None  # at most one call (auto, any, tool)

    @model_validator(mode="after")
    def _name_with_tool(self) -> "ToolChoiceParam":
        if (self.name is not None) != (self.type == "tool"):
            raise ValueError('name is required with type "tool", and only there')
        return self

    def chat_tool_choice(self) -> ToolChoice:
        if self.type == "tool":
            assert self.name is not None
            return NamedToolChoice(type="function", function=FunctionName(name=self.name))
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]  # type: ignore[return-value]


class ThinkingParam(StrictBody):
    """Anthropic's `thinking`: on or off through the template's switch (`reasoning.thinking_variables`)."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)  # tokens; only where it cannot bind (see MessagesBody)

    @model_validator(mode="after")
    def _budget_with_enabled(self) -> "ThinkingParam":
        if self.budget_tokens is not None and self.type != "enabled":
            raise ValueError('budget_tokens goes with type "enabled" only')
        return self


class Metadata(StrictBody):
    user_id: str | None = Field(default=None, max_length=256)  # Anthropic's abuse tracking; unused here


class MessagesBody(StrictBody):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: Annotated[list[TextBlock], BeforeValidator(_as_blocks)] | None = None  # a string: one text block
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoiceParam | None = None
    stream: NotStreamed = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: this deployment
    thinking: ThinkingParam | None = None

    @model_validator(mode="after")
    def _budget_cannot_bind(self) -> "MessagesBody":
        # Nothing here stops the thinking at a token count; a budget is honoured exactly only where it cannot bind.
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget < self.max_tokens:
            raise ValueError(
                f"thinking.budget_tokens={budget} is not supported below max_tokens ({self.max_tokens}): conveyor "
                "cannot stop the thinking at a token count; leave budget_tokens out (or at least max_tokens) and "
                "bound the whole answer, thinking included, with max_tokens"
            )
        return self

    def thinking_asked(self) -> ThinkingAsked | None:
        if self.thinking is None:
            return None
        return ThinkingAsked(on=self.thinking.type == "enabled", said_by=f"thinking.type={self.thinking.type!r}")

    def chat_messages(self) -> list[ChatMessage]:
        turns: list[ChatMessage] = []
        if self.system is not None:
            turns.append(ChatMessage(role="system", content="\n".join(block.text for block in self.system)))
        for message in self.messages:
            turns += message.chat_turns()
        return turns

    def sampling_kwargs(self) -> dict[str, Any]:
        sampling = self.model_dump(include={"temperature", "top_p", "top_k"}, exclude_none=True)
        if self.stop_sequences:
            sampling["stop"] = self.stop_sequences
        return sampling


# ---------------------------------------------------------------------------------------------------------
# The answer


class ThinkingOut(BaseModel):
    """The thinking of a model whose template thinks (jobs.openai_format.reasoning), before the answer."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic signs its models' thinking; there is nothing to verify here


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    input_tokens: int  # prompt tokens computed (not read from the prefix cache)
    output_tokens: int
    cache_creation_input_tokens: int = 0  # the prefix cache fills as it goes, unbilled
    cache_read_input_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageObject(AnswerBody):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: StopReason
    stop_sequence: str | None
    usage: MessageUsage

    def token_counts(self) -> TokenCounts:
        cached = self.usage.cache_read_input_tokens
        return TokenCounts(self.usage.input_tokens + cached, self.usage.output_tokens, cached)


class AnthropicMessages:
    url = MESSAGES
    model_kind: ModelKind = "generation"

    def read(self, custom_id: str, body: dict[str, Any], line: LineReader) -> BatchRequest:
        params = parse_body(MessagesBody, body)
        adapter = line.check_model(params.model, "generation")
        tools = [tool.as_chat_tool() for tool in params.tools] if params.tools else None
        choice = params.tool_choice
        plan, constraint = line.with_tools(
            None,
            tools,
            choice.chat_tool_choice() if choice is not None else None,
            None if choice is None or choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use,
        )
        prompt = line.encode_chat(
            params.chat_messages(), tools if plan is not None else None, thinking=params.thinking_asked()
        )
        generation = Generation(
            adapter=adapter,
            prompts=[prompt.token_ids],
            requested_max_tokens=params.max_tokens,
            default_max_tokens=None,
            sampling=params.sampling_kwargs(),
            constraint=constraint,
            tool_calls=plan,
            reasoning=prompt.reasoning,
            images=prompt.images,
        )
        return line.request(custom_id, self.url, generation)

    def answer(
        self,
        request: BatchRequest,
        results: Sequence[GenerationResult],
        counts: TokenCounts,
        *,
        model: str,
        tokenizer: PromptTokenizer,
    ) -> MessageObject:
        (result,) = results  # one prompt, one sample: Messages has no n
        sample = result.outputs[0]
        answer = read_sample(sample, request, tokenizer)
        text, calls = answer.text, answer.calls
        content: list[ThinkingOut | TextOut | ToolUseOut] = []
        if answer.reasoning is not None:
            content.append(ThinkingOut(thinking=answer.reasoning))
        if text or not calls:
            content.append(TextOut(text=text or ""))
        content += [
            ToolUseOut(
                id="toolu_" + call.id.removeprefix("call_"), name=call.function.name, input=json.loads(call.function.arguments)
            )
            for call in calls
        ]
        stop_sequence = sample.stop_reason if isinstance(sample.stop_reason, str) else None
        stop_reason: StopReason
        if sample.finish_reason == "length":
            stop_reason = "max_tokens"
        elif calls:
            stop_reason = "tool_use"
        elif stop_sequence is not None:
            stop_reason = "stop_sequence"
        else:
            stop_reason = "end_turn"
        return MessageObject(
            id="msg_" + uuid.uuid4().hex,
            model=model,
            content=content,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=MessageUsage(
                input_tokens=counts.input_tokens - counts.cached_tokens,
                output_tokens=counts.output_tokens,
                cache_read_input_tokens=counts.cached_tokens,
            ),
        )
