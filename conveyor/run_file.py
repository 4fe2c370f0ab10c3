"""Run one OpenAI Batch input file through a local engine, offline: the heart of `conveyor run`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.batch_format import (
    BatchLineValidator,
    BatchOutputLine,
    BatchRequest,
    EmbeddingRequest,
    TextEmbedder,
    embedding_records,
    error_record,
    response_record,
)

if TYPE_CHECKING:
    from engine import LLM


@dataclass(frozen=True)
class RunSummary:
    total: int
    succeeded: int
    failed: int
    failures_by_code: dict[str, int] = field(default_factory=dict)


def _bundled_embedder() -> TextEmbedder:
    from engine import Embedder

    return Embedder()


def run_batch_file(
    input_path: Path,
    output_path: Path,
    llm: LLM,
    *,
    progress: bool,
    make_embedder: Callable[[], TextEmbedder] = _bundled_embedder,
) -> RunSummary:
    """Validate every line, run all valid requests together, and write one output line per input line.

    The output keeps input order and holds successes and error records alike, so a single results file
    accounts for every request. Blank lines are skipped: they carry no request to answer. Embedding lines
    are embedded together, in one call of the model `make_embedder()` builds, only if the file has some.
    """
    validator = BatchLineValidator(llm.tokenizer, llm.max_model_len)
    with input_path.open("rb") as source:
        checked = [validator.validate(line) for line in source if line.strip()]

    requests = [item for item in checked if isinstance(item, BatchRequest)]
    embedding_requests = [item for item in checked if isinstance(item, EmbeddingRequest)]
    # One embedder call for the whole file as well: its packing by token budget spans lines.
    embedded_in_order = iter(embedding_records(embedding_requests, make_embedder()) if embedding_requests else [])
    # One generate call for the whole file, so the engine batches continuously across every request.
    results = (
        llm.generate(
            [request.prompt_token_ids for request in requests],
            [request.sampling_params for request in requests],
            use_tqdm=progress,
        )
        if requests
        else []
    )
    results_in_order = iter(results)

    records = [
        response_record(item, next(results_in_order), model=llm.model_name, tokenizer=llm.tokenizer)
        if isinstance(item, BatchRequest)
        else next(embedded_in_order)
        if isinstance(item, EmbeddingRequest)
        else error_record(item)
        for item in checked
    ]
    with output_path.open("w", encoding="utf-8") as sink:
        for record in records:
            sink.write(record.model_dump_json() + "\n")
    return _summarize(records)


def _summarize(records: list[BatchOutputLine]) -> RunSummary:
    failure_codes: Counter[str] = Counter(record.error.code for record in records if record.error is not None)
    failed = sum(failure_codes.values())
    return RunSummary(
        total=len(records), succeeded=len(records) - failed, failed=failed, failures_by_code=dict(failure_codes)
    )
