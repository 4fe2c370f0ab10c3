"""RAG preprocessing of documents: split, optionally contextualize, embed, with a per-document cache.

    processor = DocumentProcessor(options, splitter, embedder.embed, generate_contexts, cache, generation_model)
    records = processor.process_many([(doc_id, text, metadata), ...])   # PassageRecords, document by document
    write_parquet_bytes(records)                                         # one Parquet part

Contextual retrieval (Anthropic's recipe): when `options.contextualize` is on, the generation model writes, for
every chunk, one or two sentences situating it within its whole document. The text embedded is then
`context + "\\n\\n" + chunk text` (`embedding_input`); the record's `text` keeps the raw chunk, `context` the
generated sentences. The prompt puts the document first, so every chunk of a document shares the prompt's prefix
and the engine's prefix cache computes the document once.

The cache maps (every setting that changes the output, the document's text) to the document's records: a document
whose text did not change between two jobs costs a lookup instead of its contexts and embeddings. Ids and metadata
are not part of the key; they are taken from the current call.

Results are Parquet (`PARQUET_SCHEMA`): one row per chunk, embeddings as lists of float32, metadata as JSON text.
"""

from __future__ import annotations

import hashlib
import json
import string
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.model_registry import DEFAULT_EMBEDDING_MODEL
from jobs.rag.splitter import Passage, SplitterConfig, TextSplitter
from jobs.storage import ObjectNotFound, ObjectStore

if TYPE_CHECKING:
    from engine.embedder import Embeddings

# Bump when splitting, the embedded text or the record layout changes: cached results made before then no longer
# match what a fresh run would produce, and the fingerprint (so every cache key) must change with them.
PROCESSING_VERSION = 1

DEFAULT_CONTEXT_PROMPT = """<document>
{document}
</document>
Here is the chunk we want to situate within the whole document:
<chunk>
{chunk}
</chunk>
Please give a short succinct context (one or two sentences) to situate this chunk within the overall document \
for the purposes of improving search retrieval of the chunk. Answer only with the succinct context and nothing else."""

_PROMPT_FIELDS = frozenset({"document", "chunk"})
_MAX_CONTEXT_TOKENS = 1024
PDF_MODES = ("text", "pages")  # a PDF's text layer (pypdf), or its pages transcribed by a VLM (jobs/rag/pages.py)
_PAGE_DPI_RANGE = (36, 300)
_MAX_PAGE_TOKENS = 8192
_COMPRESSION = "zstd"
_CACHE_IO_THREADS = 8  # concurrent S3 requests for cache lookups and stores: each one is mostly network wait

Metadata = dict[str, Any]
DocumentInput = tuple[str, str, Metadata | None]  # (doc_id, text, metadata)
EmbedFunction = Callable[[list[str]], "Embeddings"]
# Contexts for several documents at once: [(document text, its chunks' texts)] → per document, a context per chunk.
# One call for all of them, so that an engine can batch every chunk of every document together.
ContextGenerator = Callable[[Sequence[tuple[str, Sequence[str]]]], list[list[str]]]


@dataclass(frozen=True)
class RagOptions:
    """A job's processing settings; everything here but nothing else decides the output for a given text."""

    chunk_tokens: int = 254  # embedding-model tokens per chunk; 254 + [CLS] + [SEP] = MiniLM's 256
    overlap_tokens: int = 32
    contextualize: bool = False
    context_prompt: str = DEFAULT_CONTEXT_PROMPT  # with {document} and {chunk}; literal braces doubled
    context_max_tokens: int = 96  # generated tokens per context
    embedding_model: str = DEFAULT_EMBEDDING_MODEL
    # "pages": PDF pages rendered and transcribed to Markdown by the worker's vision-language model; other files as
    # in "text". Not in the fingerprint: the cache is keyed by the text processed, here the transcription itself.
    pdf_mode: str = "text"
    page_dpi: int = 144  # dots per inch a page is rendered at ("pages" only); the model's processor then resizes it
    page_max_tokens: int = 1024  # generated tokens per page's transcription ("pages" only)

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "overlap_tokens", "context_max_tokens", "page_dpi", "page_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        SplitterConfig(chunk_tokens=self.chunk_tokens, overlap_tokens=self.overlap_tokens)  # raises on a bad budget
        if not isinstance(self.contextualize, bool):
            raise ValueError(f"contextualize must be true or false, got {self.contextualize!r}")
        if not 1 <= self.context_max_tokens <= _MAX_CONTEXT_TOKENS:
            raise ValueError(f"context_max_tokens must be between 1 and {_MAX_CONTEXT_TOKENS}, got {self.context_max_tokens}")
        if self.pdf_mode not in PDF_MODES:
            raise ValueError(f"pdf_mode must be one of {list(PDF_MODES)}, got {self.pdf_mode!r}")
        low, high = _PAGE_DPI_RANGE
        if not low <= self.page_dpi <= high:
            raise ValueError(f"page_dpi must be between {low} and {high}, got {self.page_dpi}")
        if not 1 <= self.page_max_tokens <= _MAX_PAGE_TOKENS:
            raise ValueError(f"page_max_tokens must be between 1 and {_MAX_PAGE_TOKENS}, got {self.page_max_tokens}")
        if not isinstance(self.embedding_model, str) or not self.embedding_model.strip():
            raise ValueError("embedding_model must be a non-empty string")
        _check_context_prompt(self.context_prompt)

    def to_json(self) -> dict[str, Any]:
        """The options as a JSON object (a dict), for a JSON column."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RagOptions:
        """Options from a JSON object; missing fields take their defaults, unknown ones are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown RAG options {unknown}; known: {sorted(known)}")
        return cls(**data)

    def fingerprint(self, generation_model: str) -> str:
        """A stable hash of every setting that changes the output; the generation model counts only when
        contextualizing, so that an embeddings-only job's cache survives a change of the worker's LLM."""
        settings: dict[str, Any] = {
            "version": PROCESSING_VERSION,
            "embedding_model": self.embedding_model,
            "chunk_tokens": self.chunk_tokens,
            "overlap_tokens": self.overlap_tokens,
            "contextualize": self.contextualize,
        }
        if self.contextualize:
            settings |= {
                "context_prompt": self.context_prompt,
                "context_max_tokens": self.context_max_tokens,
                "generation_model": generation_model,
            }
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8")).hexdigest()


def _check_context_prompt(prompt: object) -> None:
    if not isinstance(prompt, str):
        raise ValueError(f"context_prompt must be a string, got {type(prompt).__name__}")
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(prompt) if name is not None}
    except ValueError as error:  # an unmatched "{" or "}"
        raise ValueError(f"context_prompt is not a valid template ({error}); write literal braces as {{{{ and }}}}") from None
    missing = sorted(_PROMPT_FIELDS - names)
    if missing:
        raise ValueError(f"context_prompt must contain {{document}} and {{chunk}}; missing: {missing}")
    unknown = sorted(names - _PROMPT_FIELDS)
    if unknown:
        raise ValueError(
            f"context_prompt may only use {{document}} and {{chunk}}, found {unknown}; write literal braces as {{{{ and }}}}"
        )


def document_cache_key(options_fingerprint: str, document_text: str) -> str:
    """The cache key of one document's records: a hash of the settings' fingerprint and the text."""
    digest = hashlib.sha256(options_fingerprint.encode("utf-8"))
    digest.update(b"\0")  # the fingerprint has a fixed length, but a separator keeps the key unambiguous anyway
    digest.update(document_text.encode("utf-8"))
    return digest.hexdigest()


def embedding_input(chunk_text: str, context: str | None) -> str:
    """The text embedded for a chunk: its context, a blank line, then the chunk; the chunk alone without one."""
    return f"{context}\n\n{chunk_text}" if context else chunk_text


@dataclass(frozen=True, eq=False)
class PassageRecord:
    doc_id: str
    chunk_index: int
    text: str  # the raw chunk, document_text[char_start:char_end]
    context: str | None  # the generated context; None when not contextualizing
    token_count: int  # embedding-model tokens of `text`, special tokens not counted
    char_start: int
    char_end: int
    metadata: Metadata | None
    embedding: np.ndarray | list[float]  # float32, 1-D

    def __eq__(self, other: object) -> bool:
        # The generated __eq__ would compare arrays elementwise and fail on the ambiguous result.
        if not isinstance(other, PassageRecord):
            return NotImplemented
        return all(
            np.array_equal(np.asarray(getattr(self, f.name)), np.asarray(getattr(other, f.name)))
            if f.name == "embedding"
            else getattr(self, f.name) == getattr(other, f.name)
            for f in fields(self)
        )


PARQUET_SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("chunk_index", pa.int32(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("context", pa.string()),
        pa.field("token_count", pa.int32(), nullable=False),
        pa.field("char_start", pa.int64(), nullable=False),
        pa.field("char_end", pa.int64(), nullable=False),
        pa.field("metadata", pa.string()),  # JSON text
        pa.field("embedding", pa.list_(pa.float32()), nullable=False),
    ]
)
_EMBEDDING_TYPE = PARQUET_SCHEMA.field("embedding").type


def records_to_table(records: Sequence[PassageRecord]) -> pa.Table:
    vectors = [np.asarray(record.embedding, dtype=np.float32).reshape(-1) for record in records]
    offsets = np.zeros(len(vectors) + 1, dtype=np.int32)
    np.cumsum([len(vector) for vector in vectors], out=offsets[1:])
    values = np.concatenate(vectors) if vectors else np.empty(0, dtype=np.float32)
    columns = {
        "doc_id": [r.doc_id for r in records],
        "chunk_index": [r.chunk_index for r in records],
        "text": [r.text for r in records],
        "context": [r.context for r in records],
        "token_count": [r.token_count for r in records],
        "char_start": [r.char_start for r in records],
        "char_end": [r.char_end for r in records],
        "metadata": [None if r.metadata is None else json.dumps(r.metadata, ensure_ascii=False) for r in records],
    }
    arrays = [pa.array(columns[field.name], type=field.type) for field in PARQUET_SCHEMA if field.name in columns]
    embedding = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.float32()), type=_EMBEDDING_TYPE)
    return pa.Table.from_arrays([*arrays, embedding], schema=PARQUET_SCHEMA)


def table_to_records(table: pa.Table) -> list[PassageRecord]:
    """Records from a table of PARQUET_SCHEMA's columns; embeddings come back as read-only float32 arrays."""
    _check_schema(table.schema)
    columns = {name: table.column(name).to_pylist() for name in PARQUET_SCHEMA.names if name != "embedding"}
    lists = table.column("embedding").combine_chunks()
    values = lists.flatten().to_numpy()
    split_points = np.cumsum(lists.value_lengths().to_numpy())[:-1]
    embeddings = np.split(values, split_points) if len(lists) else []
    return [
        PassageRecord(
            doc_id=columns["doc_id"][row],
            chunk_index=columns["chunk_index"][row],
            text=columns["text"][row],
            context=columns["context"][row],
            token_count=columns["token_count"][row],
            char_start=columns["char_start"][row],
            char_end=columns["char_end"][row],
            metadata=None if columns["metadata"][row] is None else json.loads(columns["metadata"][row]),
            embedding=embeddings[row],
        )
        for row in range(table.num_rows)
    ]


def write_parquet_bytes(records: Sequence[PassageRecord]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(records_to_table(records), sink, compression=_COMPRESSION)
    return bytes(sink.getvalue())


def read_parquet_bytes(data: bytes) -> list[PassageRecord]:
    return table_to_records(_read_table(data))


def merge_parquet_parts(parts: Iterable[bytes], sink: BinaryIO) -> int:
    """Write the parts' rows, in order, as one Parquet file into `sink` (left open); returns the rows written.
    Parts are read one at a time, each becoming row groups of the output, so memory holds one part."""
    rows = 0
    with pq.ParquetWriter(sink, PARQUET_SCHEMA, compression=_COMPRESSION) as writer:
        for part in parts:
            table = _read_table(part)
            writer.write_table(table)
            rows += table.num_rows
    return rows


def _read_table(data: bytes) -> pa.Table:
    table = pq.read_table(pa.BufferReader(data))
    _check_schema(table.schema)
    return table


def _check_schema(schema: pa.Schema) -> None:
    if not schema.equals(PARQUET_SCHEMA):
        raise ValueError(f"not a RAG chunk table: expected columns {PARQUET_SCHEMA}, got {schema}")


class PassageCache(Protocol):
    """A document's records by cache key (`document_cache_key`)."""

    def get(self, key: str) -> list[PassageRecord] | None: ...

    def put(self, key: str, records: Sequence[PassageRecord]) -> None: ...


class ObjectStorePassageCache:
    """One Parquet object per document under `prefix` (a project's own, e.g. `object_keys.rag_cache_prefix`:
    a hit would tell one tenant that another processed the same text)."""

    def __init__(self, store: ObjectStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def get(self, key: str) -> list[PassageRecord] | None:
        try:
            data = self.store.read_bytes(self._object_key(key))
        except ObjectNotFound:
            return None
        try:
            return read_parquet_bytes(data)
        except ValueError:  # pyarrow's ArrowInvalid included: a damaged entry is recomputed and overwritten
            return None

    def put(self, key: str, records: Sequence[PassageRecord]) -> None:
        self.store.put_bytes(self._object_key(key), write_parquet_bytes(records))

    def _object_key(self, key: str) -> str:
        return f"{self.prefix}{key}.parquet"


@dataclass
class ProcessingStats:
    documents: int = 0
    documents_from_cache: int = 0
    chunks: int = 0  # records returned
    chunks_embedded: int = 0  # embedded by this processor (not from the cache)
    contexts_generated: int = 0
    pages_transcribed: int = 0  # PDF pages read as pages (`pdf_mode` "pages", counted by the RAG kind)
    pages_failed: int = 0
    pages_from_cache: int = 0  # in PDFs whose transcription came from the cache
    transcription_seconds: float = 0.0
    embedding_seconds: float = 0.0
    context_seconds: float = 0.0


@dataclass(frozen=True)
class _Document:
    """A document missing from the cache, split."""

    cache_key: str
    doc_id: str
    metadata: Metadata | None
    passages: list[Passage]
    text: str


class DocumentProcessor:
    """Turns documents into PassageRecords with one job's options; `stats` adds up over every call.

    `splitter` must count the tokens of `options.embedding_model` (`TextSplitter.for_embedding_model`); its budget
    is replaced by the options'. `generate_contexts` is needed when contextualizing (`contextualize.
    engine_context_generator`); `generation_model` names its model in the cache fingerprint."""

    def __init__(
        self,
        options: RagOptions,
        splitter: TextSplitter,
        embed: EmbedFunction,
        generate_contexts: ContextGenerator | None,
        cache: PassageCache | None,
        generation_model: str,
    ) -> None:
        if options.contextualize and generate_contexts is None:
            raise ValueError("contextualize is on but no context generator was given")
        self.options = options
        self.splitter = splitter.with_config(
            SplitterConfig(chunk_tokens=options.chunk_tokens, overlap_tokens=options.overlap_tokens)
        )
        self.embed = embed
        self.generate_contexts = generate_contexts
        self.cache = cache
        self.fingerprint = options.fingerprint(generation_model)
        self.stats = ProcessingStats()

    def process(self, doc_id: str, text: str, metadata: Metadata | None) -> list[PassageRecord]:
        return self.process_many([(doc_id, text, metadata)])

    def process_many(self, documents: Sequence[DocumentInput]) -> list[PassageRecord]:
        """Records of every document, in input order; a document without text has none. Only the documents missing
        from the cache are split and computed, together: all their contexts requested in one call, all their chunks
        embedded in one call (so the embedder packs batches across documents); a text repeated in `documents` once."""
        keys = [document_cache_key(self.fingerprint, text) for _, text, _ in documents]
        distinct: dict[str, DocumentInput] = {}  # the first document of each distinct text
        for key, document in zip(keys, documents):
            if document[1].strip():  # blank: no chunks, nothing to look up
                distinct.setdefault(key, document)
        cached = self._lookup(list(distinct))
        missing = [
            _Document(key, doc_id, metadata, self.splitter.split(text), text)
            for key, (doc_id, text, metadata) in distinct.items()
            if key not in cached
        ]
        computed = self._compute([document for document in missing if document.passages])
        self._store(computed)

        records: list[PassageRecord] = []
        for key, (doc_id, _, metadata) in zip(keys, documents):
            from_cache = key in cached
            self.stats.documents_from_cache += from_cache
            own = cached[key] if from_cache else computed.get(key, [])
            records += [replace(record, doc_id=doc_id, metadata=metadata) for record in own]
        self.stats.documents += len(documents)
        self.stats.chunks += len(records)
        return records

    def _lookup(self, keys: list[str]) -> dict[str, list[PassageRecord]]:
        cache = self.cache
        if cache is None or not keys:
            return {}
        with ThreadPoolExecutor(min(_CACHE_IO_THREADS, len(keys))) as pool:
            found = pool.map(cache.get, keys)
            return {key: records for key, records in zip(keys, found) if records is not None}

    def _store(self, computed: dict[str, list[PassageRecord]]) -> None:
        cache = self.cache
        if cache is None or not computed:
            return
        with ThreadPoolExecutor(min(_CACHE_IO_THREADS, len(computed))) as pool:
            list(pool.map(lambda item: cache.put(*item), computed.items()))  # list(): re-raise a failed put

    def _compute(self, documents: list[_Document]) -> dict[str, list[PassageRecord]]:
        if not documents:
            return {}
        contexts = self._contexts(documents)
        inputs = [
            embedding_input(passage.text, context)
            for document, document_contexts in zip(documents, contexts)
            for passage, context in zip(document.passages, document_contexts)
        ]
        started = time.perf_counter()
        vectors = self.embed(inputs).vectors
        self.stats.embedding_seconds += time.perf_counter() - started
        self.stats.chunks_embedded += len(inputs)

        computed: dict[str, list[PassageRecord]] = {}
        row = 0
        for document, document_contexts in zip(documents, contexts):
            computed[document.cache_key] = [
                PassageRecord(
                    doc_id=document.doc_id,
                    chunk_index=passage.index,
                    text=passage.text,
                    context=context,
                    token_count=passage.token_count,
                    char_start=passage.char_start,
                    char_end=passage.char_end,
                    metadata=document.metadata,
                    embedding=vectors[row + offset],
                )
                for offset, (passage, context) in enumerate(zip(document.passages, document_contexts))
            ]
            row += len(document.passages)
        return computed

    def _contexts(self, documents: list[_Document]) -> list[list[str | None]]:
        """Per document, a context per chunk; None everywhere when not contextualizing."""
        if not self.options.contextualize:
            return [[None] * len(document.passages) for document in documents]
        assert self.generate_contexts is not None  # checked in __init__
        started = time.perf_counter()
        generated = self.generate_contexts([(d.text, [passage.text for passage in d.passages]) for d in documents])
        self.stats.context_seconds += time.perf_counter() - started
        if [len(contexts) for contexts in generated] != [len(d.passages) for d in documents]:
            raise ValueError("the context generator must return one context per chunk of every document")
        self.stats.contexts_generated += sum(len(contexts) for contexts in generated)
        return [list(contexts) for contexts in generated]
