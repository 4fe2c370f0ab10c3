"""The OpenAI Batch file format: one input line in, one engine request (or an error) out, and back.

An input line is `{"custom_id", "method": "POST", "url", "body"}`; an output line is
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}` with exactly one of
`response` and `error` set. Every problem with a line becomes an error record for that line, never an
exception, so one bad line cannot fail a whole file.

Pure apart from a tokenizer (prompts must be counted against the context): the service's `validate`
task and the offline `conveyor run` command share it without loading a model. Embedding lines need no
tokenizer to validate; `embedding_records` answers them with whatever `TextEmbedder` the caller holds.

max_tokens policy (OpenAI's): a prompt must leave room for at least one generated token. An explicit
`max_tokens` / `max_completion_tokens` that does not fit beside the prompt is rejected with
`context_length_exceeded`, as OpenAI does, rather than silently shortened. Without one, chat completions
may use the whole remaining context and completions default to 16 tokens, cut to the remaining context.

Embeddings policy: a text longer than the embedding model's max_seq_length is truncated, as
sentence-transformers (the model's own library) does, where OpenAI would refuse the request; usage counts
the tokens after truncation. Empty strings and token-id inputs are refused per line (OpenAI refuses the
former; OpenAI's token ids mean nothing to another model's vocabulary). `dimensions` is accepted only when
it equals the model's dimension, which is known once the model is loaded, so that check happens when the
line runs, not in validate.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, TypeVar, cast, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the API process imports this module; numpy stays out of it
    import numpy as np

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
ENDPOINTS: tuple[Endpoint, ...] = get_args(Endpoint)
CHAT_COMPLETIONS: Endpoint = "/v1/chat/completions"
COMPLETIONS: Endpoint = "/v1/completions"
EMBEDDINGS: Endpoint = "/v1/embeddings"
EncodingFormat = Literal["float", "base64"]

ErrorCode = Literal[
    "invalid_json_line",  # not JSON, or not a JSON object
    "invalid_custom_id",  # missing, not a string, or empty
    "duplicate_custom_id",
    "invalid_method",
    "invalid_url",  # not an endpoint conveyor serves
    "mismatched_endpoint",  # a served endpoint, but not the one the batch was created for
    "invalid_body",  # body missing or not shaped like the endpoint's request
    "invalid_parameter",  # well-typed but out of range or contradictory
    "context_length_exceeded",
    "generation_aborted",
    "batch_expired",  # the batch's completion window ended before this request ran to the end
]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of texts in one embeddings request


class PromptTokenizer(Protocol):
    """The part of `engine.tokenizer.Tokenizer` that validating and answering a line needs."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...


class EmbeddedTexts(Protocol):
    """What `engine.Embedder.embed` returns (`Embeddings`)."""

    @property
    def vectors(self) -> np.ndarray: ...  # [N, dimension] float32, row i embeds text i

    @property
    def token_counts(self) -> Sequence[int]: ...  # tokens per text after truncation


class TextEmbedder(Protocol):
    """The part of `engine.Embedder` that answering embedding lines needs."""

    @property
    def model_name(self) -> str: ...

    @property
    def dimension(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> EmbeddedTexts: ...


# ---------------------------------------------------------------------------------------------------------
# Request bodies


class _StrictBody(BaseModel):
    # Strict: a temperature of "0.7" or a max_tokens of true is a client bug worth reporting, not coercing.
    # Unknown parameters are rejected so that e.g. response_format is never silently ignored.
    model_config = ConfigDict(strict=True, extra="forbid")


def _join_text_parts(content: object) -> object:
    """OpenAI allows content as a list of typed parts; a text-only model can take only the text ones."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ValueError('content parts must be {"type": "text", "text": "..."}; only text input is supported')
        texts.append(part["text"])
    return "\n".join(texts)


def _as_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


def _single_prompt(prompt: object) -> object:
    """Accept one prompt as text or token ids, also wrapped in a one-element list as OpenAI clients send it."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(item, (str, list)) for item in prompt):
        raise ValueError("a batch line takes exactly one prompt; put each prompt on its own line")
    if isinstance(prompt, list) and all(type(item) is int and item >= 0 for item in prompt):
        return prompt
    raise ValueError("prompt must be a string or a list of token ids (integers >= 0)")


class ChatMessage(_StrictBody):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_join_text_parts)]
    name: str | None = None  # accepted for client compatibility; chat templates have no place for it


class _SamplingFields(_StrictBody):
    """Parameters both endpoints share. None means "not given": the engine's (= OpenAI's) default applies."""

    model: str | None = None  # conveyor serves one model per deployment; it answers whatever is named
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

    def sampling_kwargs(self) -> dict[str, Any]:
        shared = set(_SamplingFields.model_fields) - {"model", "user"}
        return self.model_dump(include=shared, exclude_none=True)


class ChatCompletionBody(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are given
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def _embedding_texts(value: object) -> object:
    """OpenAI's `input`: one text or a list of them. Token-id inputs (a list of ints, or of int lists) are refused
    with a message of their own, rather than pydantic's list of type errors."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, (int, list)) for item in value):
        raise ValueError("token-id input is not supported; send the text (a string or a list of strings)")
    return value


class EmbeddingBody(_StrictBody):
    input: Annotated[list[str], BeforeValidator(_embedding_texts), Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    model: str | None = None  # as for the other endpoints: the deployment's one embedding model answers
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
    prompt: Annotated[str | list[int], BeforeValidator(_single_prompt)]
    max_tokens: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None

    @field_validator("echo")
    @classmethod
    def _reject_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise ValueError("echo=true is not supported; the prompt is not repeated in the output")
        return echo


# ---------------------------------------------------------------------------------------------------------
# Validating input lines


@dataclass(frozen=True)
class BatchRequest:
    """A valid line, ready for `LLM.generate`."""

    custom_id: str
    url: Endpoint
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


@dataclass(frozen=True)
class EmbeddingRequest:
    """A valid /v1/embeddings line, ready for `embedding_records`."""

    custom_id: str
    texts: list[str]
    encoding_format: EncodingFormat
    dimensions: int | None


@dataclass(frozen=True)
class LineError:
    """Why a line cannot run. custom_id is None when the line did not carry a readable one."""

    custom_id: str | None
    code: ErrorCode
    message: str


class _LineRejected(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class BatchLineValidator:
    """Validates the lines of one batch input file, in order.

    One validator per file: it remembers the custom_ids it has seen, and every later line that repeats
    one is rejected (the first keeps running). `endpoint` is the batch's endpoint, which every line's url
    must match; None accepts every endpoint conveyor serves.
    """

    def __init__(self, tokenizer: PromptTokenizer, max_model_len: int, endpoint: Endpoint | None = None) -> None:
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._endpoint = endpoint
        self._seen_custom_ids: set[str] = set()

    def validate(self, line: str | bytes) -> BatchRequest | EmbeddingRequest | LineError:
        custom_id: str | None = None
        try:
            fields = _parse_json_object(line)
            custom_id = _read_custom_id(fields)
            if custom_id in self._seen_custom_ids:
                raise _LineRejected("duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line")
            self._seen_custom_ids.add(custom_id)
            url = self._read_url(fields)
            return self._build_request(custom_id, url, fields.get("body"))
        except _LineRejected as rejected:
            return LineError(custom_id=custom_id, code=rejected.code, message=rejected.message)

    def _read_url(self, fields: Mapping[str, Any]) -> Endpoint:
        method = fields.get("method")
        if method != "POST":
            raise _LineRejected("invalid_method", f"method must be 'POST', got {method!r}")
        url = fields.get("url")
        if url not in ENDPOINTS:
            raise _LineRejected("invalid_url", f"url must be one of {list(ENDPOINTS)}, got {url!r}")
        if self._endpoint is not None and url != self._endpoint:
            raise _LineRejected(
                "mismatched_endpoint", f"url {url!r} does not match the batch's endpoint {self._endpoint!r}"
            )
        return url

    def _build_request(self, custom_id: str, url: Endpoint, body: object) -> BatchRequest | EmbeddingRequest:
        if body is None:
            raise _LineRejected("invalid_body", "missing 'body': the request to run")
        if not isinstance(body, dict):
            raise _LineRejected("invalid_body", f"'body' must be a JSON object, got {type(body).__name__}")
        if url == EMBEDDINGS:
            embedding = _parse_body(EmbeddingBody, body)
            encoding_format = embedding.encoding_format or "float"
            return EmbeddingRequest(custom_id, embedding.input, encoding_format, embedding.dimensions)
        if url == CHAT_COMPLETIONS:
            chat = _parse_body(ChatCompletionBody, body)
            prompt_token_ids = self._encode_chat(chat.messages)
            requested_max_tokens = chat.max_tokens if chat.max_completion_tokens is None else chat.max_completion_tokens
            default_max_tokens = None
            logprobs = _chat_logprobs_count(chat)
            sampling = chat.sampling_kwargs()
        else:
            completion = _parse_body(CompletionBody, body)
            prompt_token_ids = self._encode_prompt(completion.prompt)
            requested_max_tokens = completion.max_tokens
            default_max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
            logprobs = completion.logprobs
            sampling = completion.sampling_kwargs()
        self._check_vocabulary("stop_token_ids", sampling.get("stop_token_ids", []))
        max_tokens = self._fit_max_tokens(len(prompt_token_ids), requested_max_tokens, default_max_tokens)
        try:
            params = SamplingParams(**sampling, max_tokens=max_tokens, logprobs=logprobs)
        except ValueError as invalid:
            raise _LineRejected("invalid_parameter", str(invalid)) from None
        return BatchRequest(custom_id, url, prompt_token_ids, params)

    def _encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        # Templates rarely know OpenAI's newer "developer" role; it means what "system" always meant.
        conversation = [
            {"role": "system" if message.role == "developer" else message.role, "content": message.content}
            for message in messages
        ]
        try:
            text = self._tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        except Exception as failure:  # the template is the model's code; it may refuse a conversation by raising
            raise _LineRejected("invalid_body", f"the model's chat template rejected 'messages': {failure}") from None
        # The template already wrote the special tokens; adding them again would double the BOS.
        return self._non_empty(self._tokenizer.encode(text, add_special_tokens=False))

    def _encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._non_empty(self._tokenizer.encode(prompt))
        self._check_vocabulary("prompt", prompt)
        return self._non_empty(prompt)

    def _check_vocabulary(self, field: str, token_ids: list[int]) -> None:
        # An id past the embedding table would crash the engine mid-batch, taking every other line with it.
        unknown = [token_id for token_id in token_ids if token_id >= self._tokenizer.vocab_size]
        if unknown:
            raise _LineRejected(
                "invalid_parameter",
                f"'{field}' holds token ids outside the vocabulary (size {self._tokenizer.vocab_size}): {unknown[:5]}",
            )

    @staticmethod
    def _non_empty(token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise _LineRejected("invalid_body", "the prompt is empty")
        return token_ids

    def _fit_max_tokens(self, prompt_tokens: int, requested: int | None, default: int | None) -> int:
        room = self._max_model_len - prompt_tokens
        if room < 1:
            raise _LineRejected(
                "context_length_exceeded",
                f"This model's maximum context length is {self._max_model_len} tokens, but the prompt has "
                f"{prompt_tokens} tokens, leaving no room for a completion. Please shorten the prompt.",
            )
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise _LineRejected(
                "context_length_exceeded",
                f"This model's maximum context length is {self._max_model_len} tokens. However, you requested "
                f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} for the "
                f"completion). Please reduce the prompt or max_tokens.",
            )
        return requested


def _parse_json_object(line: str | bytes) -> Mapping[str, Any]:
    try:
        value = json.loads(line)
    except ValueError as invalid:  # also covers bytes that are not UTF-8
        raise _LineRejected("invalid_json_line", f"line is not valid JSON: {invalid}") from None
    if not isinstance(value, dict):
        raise _LineRejected("invalid_json_line", f"line must be a JSON object, got {type(value).__name__}")
    return value


def _read_custom_id(fields: Mapping[str, Any]) -> str:
    custom_id = fields.get("custom_id")
    if custom_id is None:
        raise _LineRejected("invalid_custom_id", "missing 'custom_id': every line needs a unique id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _LineRejected("invalid_custom_id", f"custom_id must be a non-empty string, got {custom_id!r}")
    return custom_id


BodyT = TypeVar("BodyT", ChatCompletionBody, CompletionBody, EmbeddingBody)


_OUT_OF_RANGE_ERRORS = {"greater_than_equal", "less_than_equal", "too_short", "too_long"}


def _parse_body(model: type[BodyT], body: dict[str, Any]) -> BodyT:
    try:
        return model.model_validate(body)
    except ValidationError as invalid:
        first = invalid.errors(include_url=False)[0]
        code: ErrorCode = "invalid_parameter" if first["type"] in _OUT_OF_RANGE_ERRORS else "invalid_body"
        more = f" (and {invalid.error_count() - 1} more problems)" if invalid.error_count() > 1 else ""
        raise _LineRejected(code, _describe(first) + more) from None


def _describe(error: ErrorDetails) -> str:
    where = "body" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"])
    match error["type"]:
        case "missing":
            return f"missing required parameter '{where}'"
        case "extra_forbidden":
            return f"unsupported parameter '{where}'"
        case "value_error":  # raised by this module's own validators: their message is the whole story
            return f"invalid '{where}': {error['ctx']['error']}"
        case _:
            return f"invalid '{where}': {error['msg']}"


def _chat_logprobs_count(chat: ChatCompletionBody) -> int | None:
    if chat.top_logprobs is not None and not chat.logprobs:
        raise _LineRejected("invalid_parameter", "top_logprobs requires logprobs to be true")
    return (chat.top_logprobs or 0) if chat.logprobs else None


# ---------------------------------------------------------------------------------------------------------
# Output records


FinishReason = Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]  # character offset of each token in the choice's text


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of the little-endian float32 bytes (encoding_format="base64")


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: ChatCompletion | TextCompletion | EmbeddingList


class BatchError(BaseModel):
    code: ErrorCode
    message: str


class BatchOutputLine(BaseModel):
    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchError | None


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
    def logprobs(self) -> Sequence[Mapping[int, float]] | None: ...  # per token: id -> logprob, sampled + top-N


class GenerationResult(Protocol):
    """A finished request, as `engine` reports it (`RequestOutput`)."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def outputs(self) -> Sequence[GeneratedSequence]: ...


def error_record(error: LineError) -> BatchOutputLine:
    return BatchOutputLine(
        id=_random_id("batch_req_"),
        custom_id=error.custom_id,
        response=None,
        error=BatchError(code=error.code, message=error.message),
    )


def response_record(
    request: BatchRequest, result: GenerationResult, *, model: str, tokenizer: PromptTokenizer
) -> BatchOutputLine:
    """The output line for a request the engine ran; an error record if the engine aborted any sample."""
    samples = sorted(result.outputs, key=lambda sample: sample.index)
    if any(sample.finish_reason not in get_args(FinishReason) for sample in samples):
        return error_record(
            LineError(request.custom_id, "generation_aborted", "the engine aborted this request before it finished")
        )
    prompt_tokens = len(result.prompt_token_ids)
    completion_tokens = sum(len(sample.token_ids) for sample in samples)
    usage = Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )
    wants_logprobs = request.sampling_params.logprobs is not None
    created = int(time.time())
    body: ChatCompletion | TextCompletion
    if request.url == CHAT_COMPLETIONS:
        top_n = request.sampling_params.logprobs or 0
        body = ChatCompletion(
            id=_random_id("chatcmpl-"),
            created=created,
            model=model,
            usage=usage,
            choices=[
                ChatChoice(
                    index=sample.index,
                    message=AssistantMessage(content=sample.text),
                    logprobs=_chat_logprobs(sample, top_n, tokenizer) if wants_logprobs else None,
                    finish_reason=cast(FinishReason, sample.finish_reason),  # aborted samples returned above
                )
                for sample in samples
            ],
        )
    else:
        body = TextCompletion(
            id=_random_id("cmpl-"),
            created=created,
            model=model,
            usage=usage,
            choices=[
                CompletionChoice(
                    index=sample.index,
                    text=sample.text,
                    logprobs=_completion_logprobs(sample, tokenizer) if wants_logprobs else None,
                    finish_reason=cast(FinishReason, sample.finish_reason),  # aborted samples returned above
                )
                for sample in samples
            ],
        )
    return _success_record(request.custom_id, body)


def embedding_records(requests: Sequence[EmbeddingRequest], embedder: TextEmbedder) -> list[BatchOutputLine]:
    """One output line per request, in order. Every runnable request's texts go to the embedder in one call, so its
    packing by token budget spans lines; a request asking for other `dimensions` than the model's gets an error."""
    dimension = embedder.dimension
    runnable = [request for request in requests if request.dimensions in (None, dimension)]
    embedded = embedder.embed([text for request in runnable for text in request.texts]) if runnable else None
    records: list[BatchOutputLine] = []
    first_row = 0
    for request in requests:
        if request.dimensions not in (None, dimension):
            message = (
                f"dimensions={request.dimensions} is not supported: {embedder.model_name} makes "
                f"{dimension}-dimensional vectors and cannot shorten them; leave dimensions out or set {dimension}"
            )
            records.append(error_record(LineError(request.custom_id, "invalid_parameter", message)))
            continue
        assert embedded is not None  # this request is runnable, so the embedder ran
        rows = range(first_row, first_row + len(request.texts))
        first_row = rows.stop
        tokens = sum(embedded.token_counts[row] for row in rows)
        body = EmbeddingList(
            data=[
                EmbeddingData(index=index, embedding=_encode_vector(embedded.vectors[row], request.encoding_format))
                for index, row in enumerate(rows)
            ],
            model=embedder.model_name,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )
        records.append(_success_record(request.custom_id, body))
    return records


def _encode_vector(vector: np.ndarray, encoding_format: EncodingFormat) -> list[float] | str:
    if encoding_format == "base64":  # what OpenAI sends: the float32 values' little-endian bytes
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _success_record(custom_id: str, body: ChatCompletion | TextCompletion | EmbeddingList) -> BatchOutputLine:
    return BatchOutputLine(
        id=_random_id("batch_req_"),
        custom_id=custom_id,
        response=BatchResponse(status_code=200, request_id=_random_id("req_"), body=body),
        error=None,
    )


def _chat_logprobs(sample: GeneratedSequence, top_n: int, tokenizer: PromptTokenizer) -> ChatChoiceLogprobs | None:
    if sample.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> TopLogprob:
        token = _token_text(tokenizer, token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    content = []
    for token_id, candidates in zip(sample.token_ids, sample.logprobs, strict=True):
        sampled = entry(token_id, candidates[token_id])
        # The engine adds the sampled token to the top-N when it ranks lower; OpenAI lists exactly N.
        top = [entry(candidate_id, logprob) for candidate_id, logprob in _best_first(candidates)[:top_n]]
        content.append(ChatTokenLogprob(**sampled.model_dump(), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


def _completion_logprobs(sample: GeneratedSequence, tokenizer: PromptTokenizer) -> CompletionLogprobs | None:
    if sample.logprobs is None:
        return None
    tokens = [_token_text(tokenizer, token_id) for token_id in sample.token_ids]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[
            candidates[token_id] for token_id, candidates in zip(sample.token_ids, sample.logprobs, strict=True)
        ],
        top_logprobs=[
            {_token_text(tokenizer, candidate_id): logprob for candidate_id, logprob in _best_first(candidates)}
            for candidates in sample.logprobs
        ],
        text_offset=list(accumulate((len(token) for token in tokens[:-1]), initial=0)) if tokens else [],
    )


def _token_text(tokenizer: PromptTokenizer, token_id: int) -> str:
    # Special tokens keep their names (e.g. the end-of-turn token), as vLLM shows them, instead of vanishing.
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _best_first(candidates: Mapping[int, float]) -> list[tuple[int, float]]:
    return sorted(candidates.items(), key=lambda candidate: candidate[1], reverse=True)


def _random_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex
