"""The RAG kind of job (`jobs.run.kinds.JobKind`): where a RAG job differs from a batch (`jobs.run` does the rest).

- validate: each input line is a document (`parse_document_line`); a bad line, a repeated id or a URI outside the
  project's inbox becomes an error record `{"doc_id", "error": {"code", "message"}}`, the others are cut into
  chunks of `CONVEYOR_RAG_DOCUMENTS_PER_CHUNK` documents.
- run_chunk: reads its documents (inline text, or the inbox object through the `ObjectStore` and `extract_text`;
  with `pdf_mode` "pages", a PDF's pages transcribed by the engine, `jobs.rag.pages`, each failed page named in the
  document's entry of the transcriptions file while the others go on), turns them into `PassageRecord`s with a `DocumentProcessor` (the worker's embedder, the engine for contexts, the
  project's passage cache), and returns the Parquet part as the chunk's output object, its `ProcessingStats` for that
  object's metadata beside the document counts.
- finalize: merges the parts into one Parquet file and writes the manifest (options, counts, models, files).

A URI is read only inside the caller's inbox (`inbox/<project>/` under the configured bucket and prefix): a job
can never make the service read another project's objects, or anything else in the bucket.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from jobs.models import Batch, File, FilePurpose, utcnow
from jobs.files import derived_file_id
from jobs.object_keys import chunk_transcriptions_key, file_key, inbox_key, rag_cache_prefix
from jobs.rag.contextualize import engine_context_generator
from jobs.rag.documents import DocumentError, S3Uri, SourceDocument, extract_text, parse_document_line
from jobs.rag.pages import Transcription, TranscriptionStopped, transcribe_pdf, transcription_cache_key
from jobs.rag.jobs import manifest_file_id
from jobs.rag.processing import (
    PassageRecord,
    DocumentInput,
    DocumentProcessor,
    ObjectStorePassageCache,
    ProcessingStats,
    RagOptions,
    merge_parquet_parts,
    write_parquet_bytes,
)
from jobs.rag.splitter import TextSplitter
from jobs.run.kinds import ChunkResult, EngineHandle, FinishedChunks
from jobs.run.split import LineNumber, RejectedLine, RequestId, ValidationTally
from jobs.settings import S3Settings, Settings
from jobs.stop_flags import StopFlags, StopReason
from jobs.storage import DEFAULT_PART_BYTES, ObjectNotFound, ObjectRefused, ObjectStore

if TYPE_CHECKING:
    from jobs.lazy_embedder import LazyEmbedder

STATS_METADATA_KEY = "stats"  # the chunk output object's metadata entry holding its ProcessingStats as JSON
# The chunk output object's metadata entry naming its page transcriptions' object; absent when it transcribed none.
TRANSCRIPTIONS_METADATA_KEY = "transcriptions"


def document_error_record(doc_id: str | None, code: str, message: str) -> bytes:
    return json.dumps({"doc_id": doc_id, "error": {"code": code, "message": message}}).encode() + b"\n"


def transcription_record(doc_id: str, transcription: Transcription) -> bytes:
    """A PDF read as pages, in the transcriptions file: its text (None when no page was transcribed), and each page
    that failed, named, while the others went on."""
    record = {
        "doc_id": doc_id,
        "pages": transcription.pages,
        "text": transcription.text if transcription.transcribed else None,
        "page_errors": [{"page": e.page, "code": e.code, "message": e.message} for e in transcription.page_errors],
    }
    return json.dumps(record, ensure_ascii=False).encode() + b"\n"


def no_page_record(doc_id: str, transcription: Transcription) -> bytes:
    """The error record of a PDF none of whose pages was transcribed: every page's reason, in page order."""
    reasons = "; ".join(f"{error.code}: {error.message}" for error in transcription.page_errors)
    message = f"none of the document's {transcription.pages} pages was transcribed ({reasons})"
    return document_error_record(doc_id, "no_page_transcribed", message)


def inbox_object_key(uri: S3Uri, s3: S3Settings, project_id: str) -> str:
    """The store key of a document URI, which must lie inside the project's inbox; a DocumentError otherwise."""
    inbox = s3.prefix + inbox_key(project_id, "")
    if uri.bucket != s3.bucket or not uri.key.startswith(inbox):
        raise DocumentError(f"{uri} is outside this project's inbox, s3://{s3.bucket}/{inbox}, the only place read")
    # S3 keys have no "..", but some S3 servers (SeaweedFS's filer) resolve such segments like a file system.
    if any(segment in ("", ".", "..") for segment in uri.key[len(inbox) :].split("/")):
        raise DocumentError(f"{uri}: empty, '.' and '..' segments are not allowed inside the inbox")
    return uri.key[len(s3.prefix) :]


class DocumentLines:
    """A RAG job's input lines, as `jobs.run.split.InputLines`: one document each."""

    def __init__(self, s3: S3Settings, project_id: str, per_chunk: int, refused: tuple[str, str] | None = None) -> None:
        self.s3 = s3
        self.project_id = project_id
        self.per_chunk = per_chunk
        self._refused = refused  # (code, message) failing the whole job: options this worker cannot run
        self._seen_ids: set[str] = set()  # ids are the rows' keys in the output: each names one document

    def check(self, line_number: LineNumber, line: bytes) -> RequestId | RejectedLine:
        try:
            document = parse_document_line(line)
        except DocumentError as invalid:
            record = _json_object(line)
            code = "invalid_document" if record is not None else "invalid_json_line"
            given_id = record.get("id") if record is not None else None  # the line's own id, when it gave one
            return _rejected(line_number, given_id if isinstance(given_id, str) else None, code, str(invalid))
        if document.id in self._seen_ids:
            return _rejected(line_number, document.id, "duplicate_document_id", f"id {document.id!r} is used twice")
        self._seen_ids.add(document.id)
        if document.uri is not None:
            try:
                inbox_object_key(document.uri, self.s3, self.project_id)
            except DocumentError as outside:
                return _rejected(line_number, document.id, "uri_outside_inbox", str(outside))
        return document.id

    def refusal(self, tally: ValidationTally) -> tuple[str, str] | None:
        return self._refused  # a RAG job may hold any number of documents

    def expired_record(self, request_id: RequestId) -> bytes:
        return expired_document_record(request_id)

    def unrun_record(self, request_id: RequestId, code: str, message: str) -> bytes:
        return document_error_record(request_id, code, message)

    def too_long(self, line_number: LineNumber, limit: int) -> RejectedLine:
        # Past the limit a document goes by uri, its bytes in the object store.
        message = f"the line is longer than this deployment's limit of {limit} bytes; give a large document by uri"
        return _rejected(line_number, None, "document_too_large", message)


def expired_document_record(doc_id: str) -> bytes:
    """The error record of a document (its line accepted by validate) that the job's expiry left unprocessed."""
    return document_error_record(doc_id, "batch_expired", "the job expired before this document was processed")


@dataclass
class _ReadDocuments:
    """A chunk's documents once read: what goes to the processor, and the error records of those that could not."""

    inputs: list[DocumentInput] = field(default_factory=list)
    lines: list[bytes] = field(default_factory=list)  # inputs[i] came from lines[i]
    errors: list[bytes] = field(default_factory=list)  # one per document that failed
    # `transcription_record` of each PDF read as pages: the text passages' offsets point into, and its failed pages
    transcriptions: list[bytes] = field(default_factory=list)
    pages_transcribed: int = 0
    pages_failed: int = 0
    pages_from_cache: int = 0
    transcription_seconds: float = 0.0
    unread: list[bytes] = field(default_factory=list)  # left unread: the job stopped
    stopped: StopReason | None = None


class RagKind:
    """Runs RAG chunks and assembles RAG outputs for the worker's `Pipeline`."""

    def __init__(
        self,
        *,
        settings: Settings,
        store: ObjectStore,
        stop_flags: StopFlags,
        engine: EngineHandle,
        embedder: LazyEmbedder,
    ) -> None:
        self.settings = settings
        self.store = store
        self.stop_flags = stop_flags
        self.engine = engine
        self.embedder = embedder
        self._splitter: TextSplitter | None = None  # the embedding model's tokenizer, loaded on the first chunk
        self._splitter_lock = threading.Lock()

    def input_lines(self, batch: Batch) -> DocumentLines:
        # A job reading pages is bound at creation to a served model that reads images (`jobs.rag.jobs.job_model`),
        # and validated by a worker serving it: this refuses it only where that model's engine reads no images after
        # all (one id announced by workers of different models), or for a job bound to no model (created before jobs
        # were bound), before any page fails.
        refused = None
        if batch.rag_options is not None and batch.rag_options.get("pdf_mode") == "pages" and not self._reads_images:
            refused = (
                "model_not_multimodal",
                f"pdf_mode 'pages' needs a vision-language model to transcribe the pages; this worker's model, "
                f"{self.engine.model_name!r}, does not take images",
            )
        return DocumentLines(self.settings.s3, batch.project_id, self.settings.rag_documents_per_chunk, refused)

    @property
    def _reads_images(self) -> bool:
        return bool(self.engine.loop.engine.accepts_images)

    # -----------------------------------------------------------------------------------------------------
    # run_chunk

    def run_chunk(self, job: Batch, chunk_index: int, numbered_lines: Sequence[tuple[LineNumber, bytes]]) -> ChunkResult:
        """Process the chunk's document lines: the Parquet part, with the stats for its metadata, and the error
        records; documents count as the lines of a batch do.

        The stop flag is read between documents. Generation cannot be interrupted once submitted, so a job that
        contextualizes processes its documents one at a time; embedding alone is quick, and all the chunk's
        documents go to the embedder in one call, packed together."""
        assert job.rag_options is not None  # every RAG job has its options
        options = RagOptions.from_json(job.rag_options)
        processor = self._processor(options, job)
        lines = [line for _, line in numbered_lines]
        read = self._read_documents(job, lines)
        processor.stats.pages_transcribed += read.pages_transcribed
        processor.stats.pages_failed += read.pages_failed
        processor.stats.pages_from_cache += read.pages_from_cache
        processor.stats.transcription_seconds += read.transcription_seconds
        records: list[PassageRecord] = []
        step = 1 if options.contextualize else max(1, len(read.inputs))
        processed, stopped = 0, read.stopped
        while processed < len(read.inputs) and stopped is None:
            records += processor.process_many(read.inputs[processed : processed + step])
            processed = min(processed + step, len(read.inputs))
            stopped = self.stop_flags.reason(job.id)
        errors = read.errors
        if stopped == StopReason.expired:  # when cancelled, as for batches: what did not run leaves no record
            errors += [expired_document_record(json.loads(line)["id"]) for line in read.lines[processed:] + read.unread]
        metadata = {STATS_METADATA_KEY: json.dumps(dataclasses.asdict(processor.stats))}
        if read.transcriptions:
            key = chunk_transcriptions_key(job.id, chunk_index)
            self.store.put_bytes(key, b"".join(read.transcriptions))  # a retried chunk writes the same object again
            metadata[TRANSCRIPTIONS_METADATA_KEY] = key
        return ChunkResult(
            output=write_parquet_bytes(records),
            errors=b"".join(errors),
            completed=processed,
            failed=len(errors),
            metadata=metadata,
        )

    def _read_documents(self, job: Batch, lines: list[bytes]) -> _ReadDocuments:
        read = _ReadDocuments()
        for position, line in enumerate(lines):
            if (stopped := self.stop_flags.reason(job.id)) is not None:
                read.unread, read.stopped = lines[position:], stopped
                break
            try:
                document = parse_document_line(line)
            except DocumentError as invalid:  # validate accepted the line: only a changed parser refuses it now
                read.errors.append(document_error_record(None, "invalid_document", str(invalid)))
                continue
            started = time.perf_counter()
            try:
                text = self._text_of(document, job)
            except TranscriptionStopped:  # the job stopped within a PDF's pages: the document is left unread
                read.unread, read.stopped = lines[position:], self.stop_flags.reason(job.id)
                break
            except ObjectNotFound:
                read.errors.append(document_error_record(document.id, "document_not_found", f"no object at {document.uri}"))
                continue
            except ObjectRefused as refused:  # a key the store cannot name (backslashes, say), or may not read
                read.errors.append(document_error_record(document.id, "unreadable_document", str(refused)))
                continue
            except DocumentError as unreadable:
                read.errors.append(document_error_record(document.id, "unreadable_document", str(unreadable)))
                continue
            if isinstance(text, Transcription):
                read.transcription_seconds += time.perf_counter() - started
                if text.from_cache:
                    read.pages_from_cache += text.pages
                else:
                    read.pages_transcribed += text.transcribed
                read.pages_failed += len(text.page_errors)
                read.transcriptions.append(transcription_record(document.id, text))
                if not text.transcribed:
                    read.errors.append(no_page_record(document.id, text))
                    continue
                text = text.text
            read.inputs.append((document.id, text, document.metadata))
            read.lines.append(line)
        return read

    def _text_of(self, document: SourceDocument, job: Batch) -> str | Transcription:
        """The document's text, or a PDF's transcription when read as pages."""
        if document.uri is None:
            assert document.text is not None  # a document line has one of the two
            return document.text
        data = self.store.read_bytes(inbox_object_key(document.uri, self.settings.s3, job.project_id))
        filename = document.uri.filename
        assert job.rag_options is not None
        options = RagOptions.from_json(job.rag_options)
        if options.pdf_mode != "pages" or not filename.lower().endswith(".pdf"):
            return extract_text(filename, data)
        # Transcribing is the costly part of a re-run: a PDF all of whose pages were transcribed before, with the same
        # model and page settings, is read from the project's cache (one whose pages failed is not kept: the failure
        # may have been the engine's, and a re-run should try again).
        cache_key = f"{rag_cache_prefix(job.project_id)}transcriptions/"
        cache_key += f"{transcription_cache_key(data, options, self.engine.model_name)}.json"
        cached = self._cached_transcription(cache_key)
        if cached is not None:
            return cached
        transcription = transcribe_pdf(
            self.engine, filename, data, options, priority=job.priority,
            window=self.settings.image_lines_in_flight, max_pixels=self.settings.image_max_pixels,
            stopped=lambda: self.stop_flags.reason(job.id) is not None,
        )
        if not transcription.page_errors:
            self.store.put_bytes(cache_key, json.dumps({"pages": transcription.pages, "text": transcription.text}).encode())
        return transcription

    def _cached_transcription(self, key: str) -> Transcription | None:
        try:
            entry = json.loads(self.store.read_bytes(key))
            return Transcription(entry["text"], entry["pages"], from_cache=True)
        except ObjectNotFound:
            return None
        except (ValueError, KeyError, TypeError):  # a damaged entry is a miss, overwritten by the fresh transcription
            return None

    def _processor(self, options: RagOptions, job: Batch) -> DocumentProcessor:
        generate_contexts = (
            engine_context_generator(
                self.engine.loop,
                self.engine.tokenizer,  # type: ignore[arg-type]  # the engine's Tokenizer
                options.context_max_tokens,
                options.context_prompt,
                priority=job.priority,
            )
            if options.contextualize
            else None
        )
        return DocumentProcessor(
            options,
            self._base_splitter(),
            self.embedder.embed,
            generate_contexts,
            ObjectStorePassageCache(self.store, rag_cache_prefix(job.project_id)),
            self.engine.model_name,
        )

    def _base_splitter(self) -> TextSplitter:
        with self._splitter_lock:
            if self._splitter is None:
                self._splitter = TextSplitter.for_embedding_model(self.embedder.model_name)
            return self._splitter

    # -----------------------------------------------------------------------------------------------------
    # finalize

    def output_file(self, finished: FinishedChunks, file_id: str) -> File:
        """The chunks' Parquet parts, in chunk order, as one Parquet file; memory holds one part at a time."""
        project_id = finished.batch.project_id
        key = file_key(project_id, file_id, "parquet")
        with tempfile.TemporaryFile() as merged:
            merge_parquet_parts((self.store.read_bytes(part) for part in finished.output_keys), merged)
            merged.seek(0)
            with self.store.upload_stream(key) as upload:
                while block := merged.read(DEFAULT_PART_BYTES):
                    upload.write(block)
        return File(
            id=file_id,
            project_id=project_id,
            filename=f"{finished.batch.id}.parquet",
            purpose=FilePurpose.batch_output,
            bytes=upload.bytes_written,
            object_key=key,
        )

    def report_files(
        self, finished: FinishedChunks, *, failed: int, output_file_id: str | None, error_file_id: str | None
    ) -> list[File]:
        """The manifest: what the job did, as a JSON file: its options and input, the documents and passages counted
        (the stats of the chunks that ran, added up; `chunks` in the JSON, the word clients know), the models, and its
        other files."""
        job, stop_reason = finished.batch, finished.stop_reason
        assert job.rag_options is not None
        options = RagOptions.from_json(job.rag_options)
        stats = self._summed_stats(finished.output_keys)
        transcriptions = self._transcriptions_file(finished) if options.pdf_mode == "pages" else None
        manifest: dict[str, Any] = {
            "object": "rag.manifest",
            "job_id": job.id,
            "status": "completed" if stop_reason is None else stop_reason.value,
            "input_file_id": job.input_file_id,
            "input_prefix": job.input_prefix,
            "options": job.rag_options,
            "embedding_model": options.embedding_model,
            "generation_model": self.engine.model_name if options.contextualize or options.pdf_mode == "pages" else None,
            "counts": {
                "documents": job.total_requests,
                "documents_completed": job.completed_requests,
                "documents_failed": failed,
                "documents_from_cache": stats.documents_from_cache,
                "chunks": stats.chunks,
                "chunks_embedded": stats.chunks_embedded,
                "contexts_generated": stats.contexts_generated,
                "pages_transcribed": stats.pages_transcribed,
                "pages_failed": stats.pages_failed,
                "pages_from_cache": stats.pages_from_cache,
            },
            "seconds": {
                "embedding": round(stats.embedding_seconds, 3),
                "contexts": round(stats.context_seconds, 3),
                "transcription": round(stats.transcription_seconds, 3),
            },
            "created_at": _iso(job.created_at),
            "finished_at": _iso(utcnow()),
            "output_file_id": output_file_id,
            "error_file_id": error_file_id,
            # pdf_mode "pages": JSONL, {"doc_id", "pages", "text"} per PDF, the text passages' offsets point into
            "transcriptions_file_id": None if transcriptions is None else transcriptions.id,
        }
        file_id = manifest_file_id(job.id)
        key = file_key(job.project_id, file_id, "json")
        data = json.dumps(manifest, indent=2).encode()
        self.store.put_bytes(key, data)
        manifest_file = File(
            id=file_id,
            project_id=job.project_id,
            filename=f"{job.id}_manifest.json",
            purpose=FilePurpose.batch_output,
            bytes=len(data),
            object_key=key,
        )
        return [manifest_file] if transcriptions is None else [manifest_file, transcriptions]

    def _transcriptions_file(self, finished: FinishedChunks) -> File:
        """The chunks' page transcriptions, in chunk order, as one JSONL file (empty when no PDF was read)."""
        job = finished.batch
        file_id = derived_file_id(job.id, "transcriptions")
        key = file_key(job.project_id, file_id, "jsonl")
        with self.store.upload_stream(key) as upload:
            for part in finished.output_keys:
                info = self.store.head(part)
                if info is not None and TRANSCRIPTIONS_METADATA_KEY in info.metadata:
                    upload.write(self.store.read_bytes(info.metadata[TRANSCRIPTIONS_METADATA_KEY]))
        return File(
            id=file_id,
            project_id=job.project_id,
            filename=f"{job.id}_transcriptions.jsonl",
            purpose=FilePurpose.batch_output,
            bytes=upload.bytes_written,
            object_key=key,
        )

    def _summed_stats(self, part_keys: list[str]) -> ProcessingStats:
        total = ProcessingStats()
        for key in part_keys:
            info = self.store.head(key)
            if info is None:
                continue
            for name, value in json.loads(info.metadata[STATS_METADATA_KEY]).items():
                setattr(total, name, getattr(total, name) + value)
        return total


def _rejected(line_number: LineNumber, doc_id: str | None, code: str, message: str) -> RejectedLine:
    located = f"line {line_number}: {message}"
    return RejectedLine(located, document_error_record(doc_id, code, located), code == "invalid_json_line")


def _json_object(line: bytes) -> dict[str, Any] | None:
    """The line as a JSON object; None if it is not one."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
        return None
    return record if isinstance(record, dict) else None


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")
