"""Run one OpenAI Batch input file through a local engine, offline: the heart of `conveyor run`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.images.engine_prompt import PlacedLine, place_line
from jobs.images.inputs import ImageLimits
from jobs.images.prefetch import ImagePrefetch, settle_images
from jobs.images.sources import ImageSources
from jobs.openai_format.records import TextEmbedder, embedding_records, error_record, response_record
from jobs.openai_format.requests import BatchRequest, EmbeddingRequest
from jobs.openai_format.responses import BatchOutputLine
from jobs.openai_format.validation import BatchLineValidator, LineError
from jobs.run.split import iter_lines
from jobs.served_models import ModelNames
from jobs.settings import DEFAULT_MAX_LINE_BYTES as MAX_LINE_BYTES
from jobs.webhooks.targets import AllowList

if TYPE_CHECKING:
    from tqdm import tqdm

    from engine import LLM
    from engine.multimodal.inputs import PlacedImage
    from engine.sampling_params import SamplingParams

READ_BLOCK_BYTES = 1024 * 1024


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
    progress: bool | Callable[..., tqdm],
    models: ModelNames,
    make_embedder: Callable[[], TextEmbedder] = _bundled_embedder,
) -> RunSummary:
    """Validate every line, run all valid requests together, and write one output line per input line.

    The output keeps input order and holds successes and error records alike, so a single results file
    accounts for every request. Blank lines are skipped: they carry no request to answer. Embedding lines
    are embedded together, in one call of the model `make_embedder()` builds, only if the file has some. A line's
    `model` must be one of `models` (else its line fails with model_not_found). `progress`: `LLM.generate`'s `use_tqdm`.
    Image lines are read (`data:` and public `https://` images, within the default `jobs.images.inputs.ImageLimits`;
    `s3://` ones need the service's store) and run with the text lines when `llm` reads images (a vision-language
    model; `models` says so), else fail with `model_not_multimodal`. Their usage counts their images' placeholders.
    """
    validator = BatchLineValidator(
        llm.tokenizer, llm.max_model_len, models=models, limits=llm.engine.admission_limits
    )
    with input_path.open("rb") as source:
        blocks = iter(lambda: source.read(READ_BLOCK_BYTES), b"")
        checked: list[BatchRequest | EmbeddingRequest | LineError] = [
            validator.validate(line) if line is not None else _too_long(number)
            for number, _, _, line in iter_lines(blocks, max_line_bytes=MAX_LINE_BYTES)
            if line is None or line.strip()
        ]

    # Image lines are read on their own threads while the embedder runs; then each is rendered with its images and
    # placed (or fails with its own code), and joins the text lines in the engine's one generate call. Every image
    # line's pixels are held until that call ends (~1.35 MB an image for LLaVA-1.5, ~24 MB a megapixel for Qwen2.5-VL):
    # `conveyor run` is for files that fit in memory; the service bounds them per chunk
    # (CONVEYOR_IMAGE_LINES_IN_FLIGHT). s3:// images need the service.
    placed: dict[int, PlacedLine] = {}
    with ImagePrefetch(ImageSources(ImageLimits(), AllowList(frozenset(), ()))) as prefetch:
        images = {
            index: prefetch.submit(item.images)
            for index, item in enumerate(checked)
            if isinstance(item, BatchRequest) and item.images is not None
        }
        embedding_requests = [item for item in checked if isinstance(item, EmbeddingRequest)]
        # One embedder call for the whole file as well: its packing by token budget spans lines.
        embedded_in_order = iter(embedding_records(embedding_requests, make_embedder()) if embedding_requests else [])
        for index, pending in images.items():
            request = checked[index]
            assert isinstance(request, BatchRequest)
            settled = settle_images(request.custom_id, pending, request.sampling_params.adapter or llm.model_name, models)
            line = (
                settled
                if isinstance(settled, LineError)
                else place_line(request, settled, llm.tokenizer, llm.engine, llm.engine.admission_limits)
            )
            if isinstance(line, LineError):
                checked[index] = line
            else:
                placed[index] = line
    requests = [(index, item) for index, item in enumerate(checked) if isinstance(item, BatchRequest)]
    # One generate call for the whole file, so the engine batches continuously across every request.
    results = (
        llm.generate(
            [prompt for index, request in requests for prompt in _prompts(request, placed.get(index))],
            [_params(request, placed.get(index)) for index, request in requests for _ in request.prompts],
            use_tqdm=progress,
            images=[_images(placed.get(index)) for index, request in requests for _ in request.prompts],
        )
        if requests
        else []
    )
    results_in_order = iter(results)

    records = [
        response_record(
            item,
            [next(results_in_order) for _ in item.prompts],
            model=item.sampling_params.adapter or llm.model_name,  # a LoRA adapter's line names the adapter
            tokenizer=llm.tokenizer,
        )
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


def _prompts(request: BatchRequest, line: PlacedLine | None) -> list[list[int]]:
    return request.prompts if line is None else [line.prompt_token_ids]


def _params(request: BatchRequest, line: PlacedLine | None) -> SamplingParams:
    return request.sampling_params if line is None else line.params


def _images(line: PlacedLine | None) -> tuple[PlacedImage, ...]:
    return () if line is None else line.images


def _too_long(line_number: int) -> LineError:
    message = f"line {line_number}: the line is longer than the limit of {MAX_LINE_BYTES} bytes"
    return LineError(None, "request_too_large", message)


def _summarize(records: list[BatchOutputLine]) -> RunSummary:
    failure_codes: Counter[str] = Counter(record.error.code for record in records if record.error is not None)
    failed = sum(failure_codes.values())
    return RunSummary(
        total=len(records), succeeded=len(records) - failed, failed=failed, failures_by_code=dict(failure_codes)
    )
