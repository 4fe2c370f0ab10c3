"""OpenAI response bodies and the Batch output line that carries one (or an error)."""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, Field, SerializeAsAny

from jobs.openai_format.tool_calls import ToolCall

ErrorCode = Literal[
    "invalid_json_line",  # not JSON, or not a JSON object
    "invalid_custom_id",  # missing, not a string, or empty
    "duplicate_custom_id",
    "invalid_method",
    "invalid_url",  # not an endpoint conveyor serves
    "mismatched_endpoint",  # a served endpoint, but not the one the batch was created for
    "invalid_body",  # body missing or not shaped like the endpoint's request
    "invalid_parameter",  # well-typed but out of range or contradictory
    "invalid_json_schema",  # response_format / guided_json / a tool's parameters: not valid JSON Schema
    "unsupported_json_schema",  # valid JSON Schema using a keyword constrained decoding cannot enforce
    "context_length_exceeded",
    "model_not_found",  # the line names a model the deployment does not serve (after aliases), or not the batch's
    "request_too_large",  # over the deployment's admission limits (engine/admission.py), or a line over the byte limit
    "invalid_line",  # a line that broke the reader itself (nested too deeply, not valid Unicode)
    "generation_failed",  # the engine failed while running this request (an engine step that blamed it)
    "generation_aborted",
    "chunk_failed",  # the request's chunk failed every attempt (a crash the engine could not pin on one request)
    "batch_expired",  # the batch's completion window ended before this request ran to the end
    # A line's images (jobs/images): checked when the line is, fetched and decoded when its chunk runs
    "too_many_images",  # more image parts than CONVEYOR_IMAGE_MAX_PER_LINE
    "image_fetch_failed",  # refused by the SSRF guard or the project's inbox, an HTTP error, the time limit, bad base64
    "image_too_large",  # over the bytes, pixels or aspect-ratio limit (a decompression bomb is refused from its header)
    "image_unreadable",  # truncated or corrupt
    "image_format_unsupported",  # not PNG, JPEG, WebP or GIF (SVG among them)
    "model_not_multimodal",  # an image for a model that reads text only
]

FinishReason = Literal["stop", "length", "tool_calls"]


class TokenCounts(NamedTuple):
    """A line's tokens, whatever its format calls them: what the batch's usage adds up."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int  # of input_tokens: read from the engine's prefix cache


class AnswerBody(BaseModel):
    """The body of a successful answer, in its endpoint format's shape (`jobs.formats`)."""

    def token_counts(self) -> TokenCounts:
        raise NotImplementedError(f"{type(self).__name__} does not say what it counts")


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens read from the engine's prefix cache instead of computed


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # of completion_tokens: the thinking, up to and including its closing tag


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Only for models that think (jobs.openai_format.reasoning): absent otherwise, as before they were served
    completion_tokens_details: CompletionTokensDetails | None = Field(default=None, exclude_if=lambda details: details is None)

    def token_counts(self) -> TokenCounts:
        return TokenCounts(self.prompt_tokens, self.completion_tokens, self.prompt_tokens_details.cached_tokens)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda calls: calls is None)  # as OpenAI: absent, not null
    # vLLM's field: the thinking of a model that thinks, apart from the answer; absent for one that does not
    reasoning_content: str | None = Field(default=None, exclude_if=lambda reasoning: reasoning is None)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(AnswerBody):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage

    def token_counts(self) -> TokenCounts:
        return self.usage.token_counts()


class CompletionLogprobs(BaseModel):
    # With echo, the prompt's tokens come first; its first token has null for its log-prob and alternatives.
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # character offset of each token in the choice's text


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class TextCompletion(AnswerBody):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage

    def token_counts(self) -> TokenCounts:
        return self.usage.token_counts()


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of the little-endian float32 bytes (encoding_format="base64")


class EmbeddingList(AnswerBody):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage

    def token_counts(self) -> TokenCounts:
        return TokenCounts(self.usage.prompt_tokens, 0, 0)  # embeddings: input only


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: SerializeAsAny[AnswerBody]  # written as the format's own model, whatever it is


class BatchError(BaseModel):
    code: ErrorCode
    message: str


class BatchOutputLine(BaseModel):
    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchError | None
