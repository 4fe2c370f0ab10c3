"""OpenAI batch lines: what the generation and embeddings kinds share (their input lines and output file).

Each line is `{"custom_id", "method", "url", "body"}`, checked by `jobs.openai_format.validation`; each result is
one output line (`jobs.openai_format.records`), successes to the output file, failures to the error file.
"""

from __future__ import annotations

from collections.abc import Sequence

from jobs.batch_limits import BatchLimits
from jobs.images.inputs import ImageLimits
from jobs.models import Batch, File
from jobs.openai_format.records import error_record
from jobs.openai_format.requests import BatchRequest, EmbeddingRequest
from jobs.openai_format.responses import BatchOutputLine
from jobs.openai_format.validation import BatchLineValidator, LineError
from jobs.run.finalize import compose_file
from jobs.run.kinds import ChunkResult, EngineHandle, FinishedChunks, TokenUsage
from jobs.run.split import LineNumber, RejectedLine, RequestId, ValidationTally
from jobs.storage import ObjectStore


class RequestLines:
    """A batch's lines: OpenAI batch requests, as `jobs.run.split.InputLines`."""

    def __init__(self, validator: BatchLineValidator, per_chunk: int, limits: BatchLimits) -> None:
        self.validator = validator
        self.per_chunk = per_chunk
        self.limits = limits
        self.embedding_inputs = 0  # texts of the embeddings lines checked so far

    def check(self, line_number: LineNumber, line: bytes) -> RequestId | RejectedLine:
        checked = self.validator.validate(line)
        if isinstance(checked, EmbeddingRequest):
            self.embedding_inputs += len(checked.texts)
        if not isinstance(checked, LineError):
            return checked.custom_id
        located = LineError(checked.custom_id, checked.code, f"line {line_number}: {checked.message}")
        return RejectedLine(located.message, jsonl(error_record(located)), checked.code == "invalid_json_line")

    def refusal(self, tally: ValidationTally) -> tuple[str, str] | None:
        return self.limits.refusal(tally.lines, self.embedding_inputs)

    def expired_record(self, request_id: RequestId) -> bytes:
        return jsonl(expired_record(request_id))

    def unrun_record(self, request_id: RequestId, code: str, message: str) -> bytes:
        return jsonl(error_record(LineError(request_id, code, message)))

    def too_long(self, line_number: LineNumber, limit: int) -> RejectedLine:
        message = f"line {line_number}: the line is longer than this deployment's limit of {limit} bytes"
        return RejectedLine(message, jsonl(error_record(LineError(None, "request_too_large", message))), False)


class OpenAILinesKind:
    """The part of `jobs.run.kinds.JobKind` both OpenAI kinds share; each adds its `run_chunk`."""

    def __init__(
        self,
        engine: EngineHandle,
        store: ObjectStore,
        per_chunk: int,
        limits: BatchLimits,
        image_limits: ImageLimits = ImageLimits(),
    ) -> None:
        self.engine = engine
        self.store = store
        self.per_chunk = per_chunk  # CONVEYOR_CHUNK_SIZE
        self.limits = limits  # how many requests (and embedding inputs) one batch may hold
        self.image_limits = image_limits  # CONVEYOR_IMAGE_*: a line's image count is checked with the line

    def validator(self, batch: Batch) -> BatchLineValidator:
        return BatchLineValidator(
            self.engine.tokenizer,
            self.engine.max_model_len,
            batch.endpoint,  # type: ignore[arg-type]
            models=self.engine.served,
            batch_model=batch.model,
            limits=self.engine.admission_limits,
            image_limits=self.image_limits,
        )

    def checked_lines(
        self, batch: Batch, lines: Sequence[tuple[LineNumber, bytes]]
    ) -> tuple[list[BatchOutputLine], list[tuple[LineNumber, BatchRequest | EmbeddingRequest]]]:
        """A chunk's lines checked again: the error records of those refused now (validate accepted them; only a
        changed model could refuse one), and the others' requests with their line numbers."""
        validator = self.validator(batch)
        refused: list[BatchOutputLine] = []
        requests: list[tuple[LineNumber, BatchRequest | EmbeddingRequest]] = []
        for line_number, line in lines:
            checked = validator.validate(line)
            if isinstance(checked, LineError):
                refused.append(error_record(checked))
            else:
                requests.append((line_number, checked))
        return refused, requests

    def input_lines(self, batch: Batch) -> RequestLines:
        return RequestLines(self.validator(batch), self.per_chunk, self.limits)

    def output_file(self, finished: FinishedChunks, file_id: str) -> File:
        batch = finished.batch
        return compose_file(self.store, batch.project_id, file_id, f"{batch.id}_output.jsonl", finished.output_keys)

    def report_files(
        self, finished: FinishedChunks, *, failed: int, output_file_id: str | None, error_file_id: str | None
    ) -> list[File]:
        return []


def expired_record(custom_id: str | None) -> BatchOutputLine:
    return error_record(LineError(custom_id, "batch_expired", "the batch expired before this request was completed"))


def jsonl(record: BatchOutputLine) -> bytes:
    return record.model_dump_json().encode() + b"\n"


def records_result(records: Sequence[BatchOutputLine]) -> ChunkResult:
    """Answers to the output object, errors to the errors object; the answers' usage summed for the batch's. A
    record that cannot be written (text that is not Unicode, say) becomes its line's error record: one line never
    costs the chunk its other results."""
    output_lines: list[bytes] = []
    error_lines: list[bytes] = []
    usage = TokenUsage()
    for record in records:
        try:
            line = jsonl(record)
        except ValueError as unwritable:  # pydantic's serialisation errors and UnicodeEncodeError alike
            failure = LineError(_writable(record.custom_id), "invalid_line", f"the result could not be written: {unwritable}")
            error_lines.append(jsonl(error_record(failure)))
            continue
        (output_lines if record.error is None else error_lines).append(line)
        usage += line_usage(record)
    return ChunkResult(b"".join(output_lines), b"".join(error_lines), len(output_lines), len(error_lines), usage=usage)


def _writable(custom_id: str | None) -> str | None:
    return None if custom_id is None else custom_id.encode("utf-8", "backslashreplace").decode("utf-8")


def line_usage(record: BatchOutputLine) -> TokenUsage:
    """A line's tokens as the Batch `usage` counts them: the input's (prompt or texts embedded) and the output's."""
    if record.response is None:
        return TokenUsage()
    return TokenUsage(*record.response.body.token_counts())
