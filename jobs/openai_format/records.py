"""Output records: engine results and embeddings as OpenAI Batch output lines (`{"id", "custom_id", "response",
"error"}`, exactly one of the last two set)."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, Protocol, cast, get_args

from jobs.openai_format.requests import CHAT_COMPLETIONS, BatchRequest, EmbeddingRequest, EncodingFormat, PromptTokenizer
from jobs.openai_format.tool_calls import ToolCallPlan, parse_tool_calls
from jobs.openai_format.responses import (
    AssistantMessage,
    BatchError,
    BatchOutputLine,
    BatchResponse,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletion,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    EmbeddingData,
    EmbeddingList,
    EmbeddingUsage,
    FinishReason,
    PromptTokensDetails,
    TextCompletion,
    TopLogprob,
    Usage,
)
from jobs.openai_format.responses_api import ResponseObject, response_object
from jobs.openai_format.validation import LineError

if TYPE_CHECKING:  # the API process imports this module; numpy stays out of it
    import numpy as np

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
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def error(self) -> str | None: ...  # why the engine could not run it (a constraint that did not compile)
    @property
    def prompt_logprobs(self) -> Sequence[Mapping[int, float] | None] | None: ...  # per prompt token, when asked


def error_record(error: LineError) -> BatchOutputLine:
    return BatchOutputLine(
        id=_random_id("batch_req_"),
        custom_id=error.custom_id,
        response=None,
        error=BatchError(code=error.code, message=error.message),
    )


def response_record(
    request: BatchRequest, results: Sequence[GenerationResult], *, model: str, tokenizer: PromptTokenizer
) -> BatchOutputLine:
    """The output line for a request the engine ran, from its results (one per prompt, in order); an error record if
    the engine refused or aborted any of them."""
    assert len(results) == len(request.prompts), (len(results), len(request.prompts))
    for result in results:
        if result.error is not None:
            return error_record(LineError(request.custom_id, "invalid_parameter", result.error))
        if any(sample.finish_reason not in get_args(FinishReason) for sample in result.outputs):
            return error_record(
                LineError(request.custom_id, "generation_aborted", "the engine aborted this request before it finished")
            )
    prompt_tokens = sum(len(result.prompt_token_ids) for result in results)
    completion_tokens = sum(len(sample.token_ids) for result in results for sample in result.outputs)
    cached_tokens = sum(result.num_cached_tokens for result in results)
    usage = Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )
    wants_logprobs = request.sampling_params.logprobs is not None
    created = int(time.time())
    body: ChatCompletion | TextCompletion | ResponseObject
    if request.response_fields is not None:  # a /v1/responses line: one prompt, one sample (the endpoint has no n)
        (result,) = results
        sample = result.outputs[0]
        text, calls = parse_tool_calls(sample.text, request.tool_calls) if request.tool_calls else (sample.text, [])
        body = response_object(
            text=text,
            calls=calls,
            finish_reason=cast(FinishReason, sample.finish_reason),
            model=model,
            echoed=dict(request.response_fields),
            input_tokens=prompt_tokens,
            output_tokens=completion_tokens,
            cached_tokens=cached_tokens,
        )
    elif request.url == CHAT_COMPLETIONS:
        (result,) = results
        top_n = request.sampling_params.logprobs or 0
        body = ChatCompletion(
            id=_random_id("chatcmpl-"),
            created=created,
            model=model,
            usage=usage,
            choices=[
                _chat_choice(
                    sample,
                    request.tool_calls,
                    _chat_logprobs(sample, top_n, tokenizer) if wants_logprobs else None,
                )
                for sample in _in_index_order(result)
            ],
        )
    else:
        # OpenAI's order for several prompts: prompt i's sample j is choice i * n + j.
        n = request.sampling_params.n
        body = TextCompletion(
            id=_random_id("cmpl-"),
            created=created,
            model=model,
            usage=usage,
            choices=[
                CompletionChoice(
                    index=prompt_index * n + sample.index,
                    text=(request.echo_texts[prompt_index] if request.echo_texts else "") + sample.text,
                    logprobs=_completion_logprobs(sample, result, request.echo_texts is not None, tokenizer)
                    if wants_logprobs
                    else None,
                    finish_reason=cast(FinishReason, sample.finish_reason),  # aborted samples returned above
                )
                for prompt_index, result in enumerate(results)
                for sample in _in_index_order(result)
            ],
        )
    return _success_record(request.custom_id, body)


def _in_index_order(result: GenerationResult) -> list[GeneratedSequence]:
    return sorted(result.outputs, key=lambda sample: sample.index)


def _chat_choice(sample: GeneratedSequence, plan: ToolCallPlan | None, logprobs: ChatChoiceLogprobs | None) -> ChatChoice:
    finish_reason = cast(FinishReason, sample.finish_reason)  # aborted samples were answered before
    content, calls = parse_tool_calls(sample.text, plan) if plan is not None else (sample.text, [])
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return ChatChoice(
        index=sample.index,
        message=AssistantMessage(content=content, tool_calls=calls or None),
        logprobs=logprobs,
        finish_reason=finish_reason,
    )


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


def _success_record(
    custom_id: str, body: ChatCompletion | TextCompletion | EmbeddingList | ResponseObject
) -> BatchOutputLine:
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


def _completion_logprobs(
    sample: GeneratedSequence, result: GenerationResult, echo: bool, tokenizer: PromptTokenizer
) -> CompletionLogprobs | None:
    """OpenAI's legacy parallel lists; with echo, the prompt's tokens first (the first with null: nothing predicts
    it), as OpenAI returns them."""
    if sample.logprobs is None:
        return None
    scored: list[tuple[int, Mapping[int, float] | None]] = list(zip(sample.token_ids, sample.logprobs, strict=True))
    if echo:
        assert result.prompt_logprobs is not None, "echo with logprobs asks the engine for the prompt's"
        scored = list(zip(result.prompt_token_ids, result.prompt_logprobs, strict=True)) + scored
    tokens = [_token_text(tokenizer, token_id) for token_id, _ in scored]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[candidates[token_id] if candidates is not None else None for token_id, candidates in scored],
        top_logprobs=[
            {_token_text(tokenizer, candidate_id): logprob for candidate_id, logprob in _best_first(candidates)}
            if candidates is not None
            else None
            for _, candidates in scored
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
