"""What every endpoint format implements (`EndpointFormat`), what the line validator lends it (`LineReader`), and
the pieces formats share: the line's rejection, the strict parse of a body, the engine results' shape."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from engine.structured_output import StructuredOutputParams
from jobs.images.inputs import ImageInputs
from jobs.openai_format.reasoning import ReasoningPlan, ThinkingAsked, reasoning_token_count, split_reasoning
from jobs.openai_format.requests import BatchRequest, ChatMessage, EmbeddingRequest, PromptTokenizer
from jobs.openai_format.responses import AnswerBody, ErrorCode, TokenCounts
from jobs.openai_format.tool_calls import Tool, ToolCall, ToolCallPlan, ToolChoice, parse_tool_calls
from jobs.served_models import ModelKind


class LineRejected(Exception):
    """The line cannot run: it becomes its error record, with this code and message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation rendered by the model's chat template."""

    token_ids: list[int]
    reasoning: ReasoningPlan | None  # the template thinks, and this prompt lets it (`jobs.openai_format.reasoning`)
    images: ImageInputs | None = None  # the conversation's image parts; token_ids are then its text alone


@dataclass(frozen=True)
class Generation:
    """What a generating format reads from a body; the validator fits it to the model (`LineReader.request`)."""

    prompts: list[list[int]]  # token ids, one engine request each
    requested_max_tokens: int | None  # the body's limit; None: `default_max_tokens`
    default_max_tokens: int | None  # None: the rest of the context, or the deployment's default
    sampling: dict[str, Any]  # SamplingParams keyword arguments the body sets
    constraint: StructuredOutputParams | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> bias
    tool_calls: ToolCallPlan | None = None
    context: object = None  # what the format's answer needs of its request (`BatchRequest.context`)
    reasoning: ReasoningPlan | None = None  # a chat prompt's (`ChatPrompt.reasoning`): constraints wait for the answer
    adapter: str | None = None  # the LoRA adapter the line's `model` names (`LineReader.check_model`); None: the base
    images: ImageInputs | None = None  # a chat prompt's (`ChatPrompt.images`): read when the line's chunk runs


class LineReader(Protocol):
    """What the line validator lends a format: the model's tokenizer and template, and the checks every line shares."""

    @property
    def tokenizer(self) -> PromptTokenizer: ...

    def check_model(self, name: str | None, kind: ModelKind) -> str | None: ...  # the LoRA adapter it names, or None

    def with_tools(
        self,
        constraint: StructuredOutputParams | None,
        tools: list[Tool] | None,
        tool_choice: ToolChoice | None,
        parallel_tool_calls: bool | None,
    ) -> tuple[ToolCallPlan | None, StructuredOutputParams | None]:
        """The line's tool plan and its one output constraint (a format, or the tool calls')."""
        ...

    def encode_chat(
        self,
        messages: list[ChatMessage],
        tools: list[Tool] | None,
        template_kwargs: Mapping[str, Any] | None = None,
        thinking: ThinkingAsked | None = None,
    ) -> ChatPrompt:
        """The conversation rendered (with the tools' prompt, `template_kwargs` as the template's variables, and the
        request's word on thinking as the template's switch: `jobs.openai_format.reasoning.thinking_variables`)."""
        ...

    def encode_prompt(self, prompt: str | list[int]) -> list[int]: ...

    def request(self, custom_id: str, url: str, generation: Generation) -> BatchRequest:
        """The engine request: max_tokens fitted to the context, sampling parameters checked, admission applied."""
        ...


class GeneratedSequence(Protocol):
    """One sample of a request, as `engine` reports it (`CompletionOutput`)."""

    @property
    def index(self) -> int: ...
    @property
    def text(self) -> str: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def stop_reason(self) -> str | int | None: ...  # the stop string or stop token id that ended it
    @property
    def logprobs(self) -> Sequence[Mapping[int, float]] | None: ...  # per token: id -> logprob, sampled + top-N


class GenerationResult(Protocol):
    """A finished request, as `engine` reports it (`RequestOutput`)."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def outputs(self) -> Sequence[GeneratedSequence]: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def error(self) -> str | None: ...  # why the engine could not run it (a constraint that did not compile)
    @property
    def prompt_logprobs(self) -> Sequence[Mapping[int, float] | None] | None: ...  # per prompt token, when asked


class EndpointFormat(Protocol):
    """One wire format of batch lines, named by the url a line carries."""

    url: str
    model_kind: ModelKind  # which kind of served model answers its lines

    def read(self, custom_id: str, body: dict[str, Any], line: LineReader) -> BatchRequest | EmbeddingRequest:
        """The body as an engine request; raises `LineRejected` for a body that cannot run."""
        ...


class GenerationFormat(EndpointFormat, Protocol):
    """A format whose lines the engine generates for."""

    def answer(
        self,
        request: BatchRequest,
        results: Sequence[GenerationResult],
        counts: TokenCounts,
        *,
        model: str,
        tokenizer: PromptTokenizer,
    ) -> AnswerBody:
        """The answer's body, from the request's results (one per prompt, in order; none refused or aborted)."""
        ...


BodyT = TypeVar("BodyT", bound=BaseModel)

_OUT_OF_RANGE_ERRORS = {"greater_than_equal", "less_than_equal", "too_short", "too_long"}


def parse_body(model: type[BodyT], body: dict[str, Any]) -> BodyT:
    """The body read by its strict model; its first problem (and how many more there are) rejects the line."""
    try:
        return model.model_validate(body)
    except ValidationError as invalid:
        first = invalid.errors(include_url=False)[0]
        code: ErrorCode = "invalid_parameter" if first["type"] in _OUT_OF_RANGE_ERRORS else "invalid_body"
        more = f" (and {invalid.error_count() - 1} more problems)" if invalid.error_count() > 1 else ""
        raise LineRejected(code, _describe(first) + more) from None


def _describe(error: ErrorDetails) -> str:
    where = "body" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"])
    match error["type"]:
        case "missing":
            return f"missing required parameter '{where}'"
        case "extra_forbidden":
            return f"unsupported parameter '{where}'"
        case "value_error":  # raised by the bodies' own validators: their message is the whole story
            return f"invalid '{where}': {error['ctx']['error']}"
        case _:
            return f"invalid '{where}': {error['msg']}"


@dataclass(frozen=True)
class SampleAnswer:
    """A sample's text read for its answer: the thinking apart (for a model that thinks), then the tool calls."""

    reasoning: str | None  # None: no thinking
    reasoning_tokens: int  # of the sample's tokens: the thinking's, up to and including its closing tag
    text: str | None  # what is left around the calls (None when there is none)
    calls: list[ToolCall]


def read_sample(sample: GeneratedSequence, request: BatchRequest, tokenizer: PromptTokenizer) -> SampleAnswer:
    split = split_reasoning(sample.text, request.reasoning) if request.reasoning is not None else None
    answer = sample.text if split is None else split.answer  # calls are looked for after the thinking
    text, calls = parse_tool_calls(answer, request.tool_calls) if request.tool_calls else (answer, [])
    if split is None:
        return SampleAnswer(None, 0, text, calls)
    return SampleAnswer(split.reasoning, reasoning_token_count(sample.token_ids, split, tokenizer), text, calls)


def in_index_order(result: GenerationResult) -> list[GeneratedSequence]:
    return sorted(result.outputs, key=lambda sample: sample.index)


def token_text(tokenizer: PromptTokenizer, token_id: int) -> str:
    # Special tokens keep their names (e.g. the end-of-turn token), as vLLM shows them, instead of vanishing.
    return tokenizer.decode([token_id], skip_special_tokens=False)


def best_first(candidates: Mapping[int, float]) -> list[tuple[int, float]]:
    return sorted(candidates.items(), key=lambda candidate: candidate[1], reverse=True)


def random_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex
