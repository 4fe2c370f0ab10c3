"""RAG documents read as pages (`pdf_mode: "pages"`, jobs/rag/pages.py): a PDF made here with Pillow, rendered by
pypdfium2 and transcribed by a tiny random LLaVA-1.5 (its transcriptions are random words: the structure is what is
checked), then split and embedded by the real embedding model, with the real S3 store and Redis stop flags."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from engine.embedder import Embedder
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.model_registry import DEFAULT_EMBEDDING_MODEL
from engine.multimodal.inputs import ImageInput
from engine.sampling_params import SamplingParams
from jobs.lazy_embedder import LazyEmbedder
from jobs.models import Batch, utcnow
from jobs.object_keys import inbox_key
from jobs.rag.kind import STATS_METADATA_KEY, RagKind
from jobs.rag.pages import PAGE_PROMPT, TranscriptionStopped, assemble, page_marker, page_messages, transcribe_pdf
from jobs.rag.processing import RagOptions, read_parquet_bytes
from jobs.object_keys import chunk_output_key
from jobs.run.kinds import EngineHandle, FinishedChunks
from jobs.run.ledger import write_chunk_result
from jobs.run.split import ValidationTally
from jobs.served_models import ModelNames, process_models
from jobs.settings import S3Settings, Settings
from jobs.stop_flags import StopFlags
from jobs.storage import ObjectStore
from tests.scanned_pages import page, pdf_of

pytestmark = pytest.mark.slow  # a tiny LLaVA and the embedding model

DPI = 36  # half of PDF's 72 points per inch: small pages for the tiny model


@pytest.fixture(scope="module")
def llava_engine(llava_folder: Path) -> Iterator[EngineHandle]:
    loop = EngineLoop.build(lambda: LLMEngine(str(llava_folder), dtype="float32", device="cpu"))
    assert loop.engine.tokenizer is not None
    served = ModelNames(process_models([loop.engine.model_name], DEFAULT_EMBEDDING_MODEL, accepts_images=True), {})
    yield EngineHandle(
        loop, loop.engine.tokenizer, loop.engine.max_model_len, loop.engine.model_name, served,
        loop.engine.admission_limits,
    )
    loop.stop()


@pytest.fixture
def stop_flags() -> Iterator[StopFlags]:
    redis = Redis.from_url("redis://127.0.0.1:6379/0")
    yield StopFlags(redis, f"test-pages-{secrets.token_hex(4)}:")
    redis.close()


def job(options: RagOptions) -> Batch:
    return Batch(
        id=f"ragjob_{secrets.token_hex(6)}", project_id="proj_pages", endpoint="/v1/rag/jobs", priority=0,
        rag_options=options.to_json(), created_at=utcnow(), total_requests=2, completed_requests=2,
    )


def test_pdf_pages_are_transcribed_split_and_embedded_and_a_failed_page_is_the_documents_error(
    llava_engine: EngineHandle, stop_flags: StopFlags, object_store: ObjectStore, s3_settings: S3Settings
) -> None:
    """Three pages, the second a poster over the pixel limit: pages 1 and 3 are transcribed, each exactly as the engine
    answers that page rendered alike, and assembled after their markers; the passages' offsets point into that
    transcription; page 2 is an error record naming the page while the document completes. With more tokens per page
    than the model's context, every page is refused: the document fails by its pages' records."""
    import pypdfium2

    pictures = [page(1, 120, 160), page(2, 600, 600), page(3, 120, 160)]
    data = pdf_of(pictures)
    object_store.put_bytes(inbox_key("proj_pages", "report.pdf"), data)
    uri = f"s3://{s3_settings.bucket}/{s3_settings.prefix}{inbox_key('proj_pages', 'report.pdf')}"
    # page 2 at 36 dpi is 300 x 300 = 90000 pixels, over the limit; pages 1 and 3 are 60 x 80
    settings = Settings(s3=s3_settings, image_max_pixels=20_000, image_lines_in_flight=1)
    embedder = LazyEmbedder(DEFAULT_EMBEDDING_MODEL, lambda: Embedder(DEFAULT_EMBEDDING_MODEL))
    kind = RagKind(settings=settings, store=object_store, stop_flags=stop_flags, engine=llava_engine, embedder=embedder)
    options = RagOptions(pdf_mode="pages", page_dpi=DPI, page_max_tokens=12, chunk_tokens=16, overlap_tokens=0)
    lines = [(1, json.dumps({"id": "report", "uri": uri}).encode()), (2, b'{"id": "note", "text": "a plain note"}')]

    rag_job = job(options)
    assert kind.input_lines(rag_job).refusal(ValidationTally()) is None  # the worker's model reads images
    hits_before = llava_engine.loop.engine.stats().prefix_cache_hit_tokens
    result = kind.run_chunk(rag_job, 0, lines)
    # Every page's prompt starts with the same instructions, before the image: page 3 reads them from the prefix cache.
    rendered_prompt = llava_engine.tokenizer.apply_chat_template(page_messages(), add_generation_prompt=True)
    assert rendered_prompt.index(PAGE_PROMPT) < rendered_prompt.index("<image>")
    assert llava_engine.loop.engine.stats().prefix_cache_hit_tokens - hits_before >= 16  # a whole block at least
    assert (result.completed, result.failed, result.errors) == (2, 0, b"")  # a page failed, not the document

    # The oracle: each page rendered by pypdfium2 at the same resolution, asked of the engine with the same prompt.
    tokenizer = llava_engine.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(page_messages(), add_generation_prompt=True), add_special_tokens=False)
    pdf = pypdfium2.PdfDocument(data)
    answers = {}
    for number in (1, 3):
        rendered = pdf[number - 1].render(scale=DPI / 72).to_pil().convert("RGB")
        assert rendered.size == (60, 80)
        handle = llava_engine.loop.submit(
            prompt, SamplingParams(temperature=0.0, max_tokens=12), images=(ImageInput(rendered),)
        )
        answers[number] = handle.result().outputs[0].text
    pdf.close()
    assert answers[1].strip() and answers[1] != answers[3]  # the pages' images, not the prompt alone, decide
    transcription = assemble([(1, answers[1]), (3, answers[3])])
    assert page_marker(1) in transcription and page_marker(3) in transcription and page_marker(2) not in transcription

    records = read_parquet_bytes(result.output)
    report = [record for record in records if record.doc_id == "report"]
    assert report and [record.chunk_index for record in report] == list(range(len(report)))
    for record in report:
        assert transcription[record.char_start : record.char_end] == record.text
    assert report[-1].char_end == len(transcription.rstrip())
    assert [record.text for record in records if record.doc_id == "note"] == ["a plain note"]  # other files as before

    # Finalize's transcriptions file gives the client the text the offsets point into; the manifest names it.
    write_chunk_result(object_store, rag_job.id, 0, result)
    finished = FinishedChunks(rag_job, [chunk_output_key(rag_job.id, 0)], None)
    manifest_file, transcriptions_file = kind.report_files(finished, failed=0, output_file_id=None, error_file_id=None)
    manifest = json.loads(object_store.read_bytes(manifest_file.object_key))
    assert manifest["transcriptions_file_id"] == transcriptions_file.id
    assert manifest["generation_model"] == llava_engine.model_name
    assert (manifest["counts"]["pages_transcribed"], manifest["counts"]["pages_failed"]) == (2, 1)
    [row] = [json.loads(row) for row in object_store.read_bytes(transcriptions_file.object_key).splitlines()]
    assert (row["doc_id"], row["pages"], row["text"]) == ("report", 3, transcription)  # the note is no PDF: not there
    [page_error] = row["page_errors"]  # the failed page, named, in its document's entry
    assert (page_error["page"], page_error["code"]) == (2, "page_too_large") and "lower page_dpi" in page_error["message"]

    # A PDF all of whose pages were transcribed is kept in the project's cache: the same PDF in another job with the
    # same model and page settings costs no engine request and gives the same passages.
    object_store.put_bytes(inbox_key("proj_pages", "clean.pdf"), pdf_of([pictures[0], pictures[2]]))
    clean = [(1, json.dumps({"id": "clean", "uri": uri.replace("report.pdf", "clean.pdf")}).encode())]
    first, second = kind.run_chunk(job(options), 0, clean), kind.run_chunk(job(options), 0, clean)
    stats = [json.loads(run.metadata[STATS_METADATA_KEY]) for run in (first, second)]
    assert [(s["pages_transcribed"], s["pages_from_cache"]) for s in stats] == [(2, 0), (0, 2)]
    assert read_parquet_bytes(second.output) == read_parquet_bytes(first.output) != []
    clean_transcription = assemble([(1, answers[1]), (2, answers[3])])  # the same pictures, numbered 1 and 2 here
    assert all(clean_transcription[r.char_start : r.char_end] == r.text for r in read_parquet_bytes(first.output))

    # Every page refused (more tokens asked than the model's context holds): the document fails, its error record
    # giving each page's reason in order.
    too_long = RagOptions(pdf_mode="pages", page_dpi=DPI, page_max_tokens=llava_engine.max_model_len + 1)
    result = kind.run_chunk(job(too_long), 0, lines[:1])
    assert (result.completed, result.failed) == (0, 1)
    [error] = [json.loads(row) for row in result.errors.splitlines()]
    assert (error["doc_id"], error["error"]["code"]) == ("report", "no_page_transcribed")
    message = error["error"]["message"]
    assert message.index("page 1:") < message.index("page_too_large: page 2 ") < message.index("page 3:")
    assert "more than the model's context" in message
    assert read_parquet_bytes(result.output) == []

    # A job stopped within a PDF: asked before each page, the stop ends the document there, its pages aborted.
    asked: list[int] = []
    with pytest.raises(TranscriptionStopped, match="stopped at page 2"):
        transcribe_pdf(
            llava_engine, "report.pdf", data, options, priority=0, window=4, max_pixels=20_000,
            stopped=lambda: asked.append(1) is None and len(asked) > 1,
        )


def test_pages_need_a_vision_model_and_valid_options() -> None:
    with pytest.raises(ValueError, match="pdf_mode must be one of"):
        RagOptions(pdf_mode="images")
    with pytest.raises(ValueError, match="page_dpi must be between 36 and 300"):
        RagOptions(pdf_mode="pages", page_dpi=600)
    with pytest.raises(ValueError, match="page_max_tokens"):
        RagOptions(page_max_tokens=0)
