"""OpenAI request bodies as conveyor reads them, and the requests a valid line becomes.

The bodies are strict pydantic models: a temperature of "0.7" or a max_tokens of true is a client bug worth
reporting, not coercing; every field is either honoured or refused (an unknown one fails its line). An endpoint adds
its body here (or, like `/v1/responses`, in a module of its own: `responses_api`) and its format in `jobs.formats`,
which reads the body and writes the answer. docs/openai_compatibility.md lists every field and what becomes of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, TypeVar, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputParams
from jobs.images.inputs import Detail, ImageInputs, ImageRef, check_image_url
from jobs.openai_format.reasoning import ReasoningEffort, ReasoningPlan
from jobs.openai_format.structured_output import ResponseFormat, constraint_from_request
from jobs.openai_format.tool_calls import ChatToolCall, Tool, ToolCallPlan, ToolChoice

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
ENDPOINTS: tuple[Endpoint, ...] = get_args(Endpoint)
CHAT_COMPLETIONS: Endpoint = "/v1/chat/completions"
COMPLETIONS: Endpoint = "/v1/completions"
EMBEDDINGS: Endpoint = "/v1/embeddings"
RESPONSES: Endpoint = "/v1/responses"
EncodingFormat = Literal["float", "base64"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of texts in one embeddings request
MAX_PROMPTS = 2048  # prompts in one completions line: a bound on one line's work, as embeddings' input list


class PromptTokenizer(Protocol):
    """The part of `engine.tokenizer.Tokenizer` that validating and answering a line needs."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @property
    def chat_template(self) -> str | None: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str: ...


class StrictBody(BaseModel):
    # Strict: a temperature of "0.7" or a max_tokens of true is a client bug worth reporting, not coercing.
    # Unknown parameters are rejected so that e.g. response_format is never silently ignored.
    model_config = ConfigDict(strict=True, extra="forbid")


class ImageUrl(StrictBody):
    url: Annotated[str, AfterValidator(check_image_url)]
    detail: Detail = "auto"  # recorded per image; the model's preprocessing gives it its meaning


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ImagePart(StrictBody):
    type: Literal["image_url"]
    image_url: ImageUrl

    def ref(self) -> ImageRef:
        return ImageRef(self.image_url.url, self.image_url.detail)


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def _text_or_parts(content: object) -> object:
    """OpenAI allows content as a list of typed parts. Text parts alone are joined into one text, as a text-only
    template expects; with an image part the list stays parts (`ChatMessage.image_refs`)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("content must be a string or a list of content parts")
    if all(isinstance(part, (TextPart, ImagePart)) for part in content):  # built in code (the other formats' turns)
        return content
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "image_url"):
            raise ValueError(
                'content parts must be {"type": "text", "text": "..."} or {"type": "image_url", "image_url": {"url": '
                f'"...", "detail": "auto|low|high"}}}}, got type {kind!r}'
            )
    if all(part["type"] == "text" and isinstance(part.get("text"), str) for part in content):
        return "\n".join(part["text"] for part in content)
    return [read_part(_CONTENT_PART, index, part) for index, part in enumerate(content)]


_CONTENT_PART: TypeAdapter[TextPart | ImagePart] = TypeAdapter(ContentPart)
PartT = TypeVar("PartT")


def read_part(parts: TypeAdapter[PartT], index: int, part: object) -> PartT:
    """One content part read in a content validator, so that its error names the part (the errors of the field's
    union, a text or parts, would name every branch)."""
    try:
        return parts.validate_python(part)
    except ValidationError as invalid:
        first = invalid.errors(include_url=False)[0]
        where = "".join(f".{step}" for step in first["loc"][1:])  # [0] is the part's type tag
        problem = first["ctx"]["error"] if first["type"] == "value_error" else first["msg"]
        raise ValueError(f"content[{index}]{where}: {problem}") from None


def _as_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


def _prompt_list(prompt: object) -> object:
    """OpenAI's `prompt`: one text, one list of token ids, or a list of either (one choice set per prompt)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(type(item) is int for item in prompt)):
        prompt = [prompt]  # one prompt ([] too: one empty prompt, refused as such when encoded)
    if not isinstance(prompt, list):
        raise ValueError("prompt must be a string or a list of token ids, or a list of those")
    for item in prompt:
        if isinstance(item, str):
            continue
        if not (isinstance(item, list) and all(type(token) is int and token >= 0 for token in item)):
            raise ValueError("each prompt must be a string or a list of token ids (integers >= 0)")
    return prompt


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[ContentPart] | None, BeforeValidator(_text_or_parts)] = None
    name: str | None = None  # the participant's name: passed to the chat template, which uses it where it has a slot
    tool_calls: list[ChatToolCall] | None = None  # an assistant turn's calls (tool_calls.py)
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _content_or_calls(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("tool messages, and only they, need tool_call_id")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (an assistant message may give tool_calls instead)")
        if self.image_refs() and self.role != "user":
            raise ValueError("only user messages carry images")
        return self

    def image_refs(self) -> list[ImageRef]:
        if not isinstance(self.content, list):
            return []
        return [part.ref() for part in self.content if isinstance(part, ImagePart)]


class _SamplingFields(StrictBody):
    """Parameters both endpoints share. None means "not given": the engine's (= OpenAI's) default applies."""

    model: str | None = None  # a served model's name or alias (else model_not_found); None: the batch's model
    user: str | None = None  # accepted for client compatibility; unused
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Annotated[list[str], BeforeValidator(_as_list), Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    best_of: int | None = None  # OpenAI's completions parameter; vLLM accepts it on chat too
    use_beam_search: bool | None = None
    beam_width: int | None = None
    length_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (as a JSON key) -> bias in [-100, 100]
    # Output constraints (structured_output.py): OpenAI's, and vLLM's guided_* extensions
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        shared = set(_SamplingFields.model_fields) - {"model", "user", "logit_bias", *_CONSTRAINT_FIELDS}
        return self.model_dump(include=shared, exclude_none=True)

    def constraint(self) -> StructuredOutputParams | None:
        return constraint_from_request(
            self.response_format, self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar
        )


_CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


# What the chat template is given by conveyor itself (and the tokenizer's special tokens, which it also passes)
_TEMPLATE_ARGUMENTS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "unk_token", "pad_token"}


def _free_template_variables(variables: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(_TEMPLATE_ARGUMENTS & set(variables))
    if taken:
        raise ValueError(f"{taken} are set by conveyor itself, not by chat_template_kwargs")
    return variables


def _not_streamed(stream: bool | None) -> bool | None:
    if stream:
        raise ValueError("stream=true is not supported: a batch line is answered by one response, not a stream")
    return stream


# OpenAI's `stream`: only false (the default) has a meaning in a batch.
NotStreamed = Annotated[bool | None, AfterValidator(_not_streamed)]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class ChatCompletionBody(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    stream: NotStreamed = None
    # Accepted no-ops, with OpenAI's meaning where it holds here: `store` asks OpenAI to keep the completion for its
    # dashboard and distillation (conveyor's output file is the only record either way); `metadata` tags that stored
    # completion; `service_tier` picks OpenAI's processing tier (a batch has one tier: this deployment).
    store: bool | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    service_tier: ServiceTier | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are given
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Thinking off ("none", "minimal") or on (the rest), where the model's template can (`reasoning.thinking_variables`)
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's extension: variables for the chat template, e.g. Qwen3's {"enable_thinking": false}
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(_free_template_variables)] | None = None


def _embedding_texts(value: object) -> object:
    """OpenAI's `input`: one text or a list of them. Token-id inputs (a list of ints, or of int lists) are refused
    with a message of their own, rather than pydantic's list of type errors."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, (int, list)) for item in value):
        raise ValueError("token-id input is not supported; send the text (a string or a list of strings)")
    return value


class EmbeddingBody(StrictBody):
    input: Annotated[list[str], BeforeValidator(_embedding_texts), Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    model: str | None = None  # as for the other endpoints: a served embedding model's name or alias
    encoding_format: EncodingFormat | None = None  # None: "float"
    dimensions: int | None = Field(default=None, ge=1)  # must equal the model's; checked when the line runs
    user: str | None = None  # accepted for client compatibility; unused

    @field_validator("input")
    @classmethod
    def _reject_empty_texts(cls, texts: list[str]) -> list[str]:
        empty = [index for index, text in enumerate(texts) if not text]
        if empty:
            raise ValueError(f"input[{empty[0]}] is an empty string; every text to embed must be non-empty")
        return texts


class CompletionBody(_SamplingFields):
    # Several prompts in one line run as one engine request each; the line's choices list them in prompt order.
    prompt: Annotated[list[str | list[int]], BeforeValidator(_prompt_list), Field(max_length=MAX_PROMPTS)]
    stream: NotStreamed = None
    max_tokens: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None  # the prompt's text before each choice's text


@dataclass(frozen=True)
class BatchRequest:
    """A valid line, ready for `LLM.generate`: one engine request per prompt, all with the same parameters."""

    custom_id: str
    url: str  # its endpoint format's (`jobs.formats.registry`)
    prompts: list[list[int]]  # token ids; only a completions line may hold more than one prompt
    sampling_params: SamplingParams
    tool_calls: ToolCallPlan | None = None  # tools are on: look for calls in the output
    # What the format's answer needs of its request: completions' echo texts, what a response object repeats
    context: object = None
    reasoning: ReasoningPlan | None = None  # the output may think first: its answer splits the thinking off
    # A chat line's images, fetched when its chunk runs (`jobs.images.prefetch`); None: a text line
    images: ImageInputs | None = None


@dataclass(frozen=True)
class EmbeddingRequest:
    """A valid /v1/embeddings line, ready for `embedding_records`."""

    custom_id: str
    texts: list[str]
    encoding_format: EncodingFormat
    dimensions: int | None
