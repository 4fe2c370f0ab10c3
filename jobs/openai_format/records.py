"""Output records: engine results and embeddings as OpenAI Batch output lines (`{"id", "custom_id", "response",
"error"}`, exactly one of the last two set)."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, get_args

from jobs.formats.base import GenerationResult, random_id
from jobs.formats.registry import GENERATION_FORMATS
from jobs.openai_format.requests import BatchRequest, EmbeddingRequest, EncodingFormat, PromptTokenizer
from jobs.openai_format.responses import (
    AnswerBody,
    BatchError,
    BatchOutputLine,
    BatchResponse,
    EmbeddingData,
    EmbeddingList,
    EmbeddingUsage,
    FinishReason,
    TokenCounts,
)
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


def error_record(error: LineError) -> BatchOutputLine:
    return BatchOutputLine(
        id=random_id("batch_req_"),
        custom_id=error.custom_id,
        response=None,
        error=BatchError(code=error.code, message=error.message),
    )


def response_record(
    request: BatchRequest, results: Sequence[GenerationResult], *, model: str, tokenizer: PromptTokenizer
) -> BatchOutputLine:
    """The output line for a request the engine ran, from its results (one per prompt, in order), answered by its
    endpoint format; an error record if the engine refused or aborted any of them."""
    assert len(results) == len(request.prompts), (len(results), len(request.prompts))
    for result in results:
        if result.error is not None:
            return error_record(LineError(request.custom_id, "invalid_parameter", result.error))
        if any(sample.finish_reason not in get_args(FinishReason) for sample in result.outputs):
            return error_record(
                LineError(request.custom_id, "generation_aborted", "the engine aborted this request before it finished")
            )
    counts = TokenCounts(
        input_tokens=sum(len(result.prompt_token_ids) for result in results),
        output_tokens=sum(len(sample.token_ids) for result in results for sample in result.outputs),
        cached_tokens=sum(result.num_cached_tokens for result in results),
    )
    answer = GENERATION_FORMATS[request.url].answer(request, results, counts, model=model, tokenizer=tokenizer)
    return _success_record(request.custom_id, answer)


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


def _success_record(custom_id: str, body: AnswerBody) -> BatchOutputLine:
    return BatchOutputLine(
        id=random_id("batch_req_"),
        custom_id=custom_id,
        response=BatchResponse(status_code=200, request_id=random_id("req_"), body=body),
        error=None,
    )
