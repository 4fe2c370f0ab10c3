"""RAG processing: options, Parquet results, the per-document cache, contexts from the engine, real embeddings.

The cache tests use a real ObjectStore on SeaweedFS and a counting stand-in embedder (what is tested is which
chunks get embedded, not the vectors); the embedding and context tests use the real all-MiniLM-L6-v2 and SmolLM2.
"""

from __future__ import annotations

import hashlib
import io
import secrets
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine import LLM, EngineLoop
from engine.embedder import Embedder, Embeddings
from engine.model_registry import DEFAULT_MODEL
from engine.tokenizer import Tokenizer
from jobs.object_keys import rag_cache_prefix
from jobs.rag.contextualize import context_prompts, engine_context_generator
from jobs.rag.processing import (
    DEFAULT_CONTEXT_PROMPT,
    PARQUET_SCHEMA,
    PassageRecord,
    DocumentProcessor,
    ObjectStorePassageCache,
    RagOptions,
    document_cache_key,
    embedding_input,
    merge_parquet_parts,
    read_parquet_bytes,
    records_to_table,
    table_to_records,
    write_parquet_bytes,
)
from jobs.rag.splitter import SplitterConfig, TextSplitter
from jobs.storage import ObjectStore

TOPICS = ("the harbour", "the railway", "the observatory", "the mill", "the library", "the bridge", "the market")


def article(seed: int, paragraphs: int = 6) -> str:
    """A small Markdown article: a title, then paragraphs of sentences that differ by seed."""
    lines = [f"# Report {seed}"]
    for p in range(paragraphs):
        topic = TOPICS[(seed + p) % len(TOPICS)]
        sentences = [
            f"In {1900 + 7 * seed + p}, the town council of Brandt voted to rebuild {topic}.",
            f"The work took {3 + (seed * p) % 9} years and employed {40 + 13 * p} people from the valley.",
            f"Visitors still describe {topic} as the heart of the old quarter, section {seed}.{p}.",
        ]
        lines.append(" ".join(sentences))
    return "\n\n".join(lines)


def record(doc_id: str, index: int, context: str | None, metadata: dict | None) -> PassageRecord:
    text = f"chunk {index} of {doc_id}: déjà vu, 東京"
    return PassageRecord(
        doc_id=doc_id, chunk_index=index, text=text, context=context, token_count=5 + index,
        char_start=100 * index, char_end=100 * index + len(text), metadata=metadata,
        embedding=np.arange(4, dtype=np.float32) + index,
    )


class CountingEmbedder:
    """Deterministic vectors from each text's hash; remembers every call's texts."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, texts: list[str]) -> Embeddings:
        self.calls.append(list(texts))
        vectors = np.stack([_hash_vector(text) for text in texts]) if texts else np.empty((0, 8), np.float32)
        return Embeddings(vectors=vectors, token_counts=[len(text.split()) for text in texts])

    @property
    def texts_embedded(self) -> int:
        return sum(map(len, self.calls))


def _hash_vector(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).standard_normal(8).astype(np.float32)


class NumberedContexts:
    """A context generator that says which document and chunk it was asked about; remembers its calls."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, list[str]]]] = []

    def __call__(self, documents: Sequence[tuple[str, Sequence[str]]]) -> list[list[str]]:
        self.calls.append([(document, list(chunks)) for document, chunks in documents])
        return [[f"From {document.splitlines()[0]}, part {i}." for i in range(len(chunks))] for document, chunks in documents]


@pytest.fixture(scope="module")
def splitter() -> TextSplitter:
    return TextSplitter.for_embedding_model()


SMALL_CHUNKS = RagOptions(chunk_tokens=48, overlap_tokens=8)


# --- Parquet ----------------------------------------------------------------------------------------------------


def test_parquet_round_trip_keeps_columns_types_and_values() -> None:
    records = [record("a", 0, None, None), record("a", 1, "Context.", {"lang": "fr", "tags": ["x", 1]})]
    table = pq.read_table(pa.BufferReader(write_parquet_bytes(records)))

    assert table.schema.names == [
        "doc_id", "chunk_index", "text", "context", "token_count", "char_start", "char_end", "metadata", "embedding"
    ]
    assert [field.type for field in table.schema] == [
        pa.string(), pa.int32(), pa.string(), pa.string(), pa.int32(), pa.int64(), pa.int64(), pa.string(),
        pa.list_(pa.float32()),
    ]
    assert table.column("context").to_pylist() == [None, "Context."]
    assert table.column("metadata").to_pylist() == [None, '{"lang": "fr", "tags": ["x", 1]}']
    assert table.column("embedding").to_pylist()[1] == [1.0, 2.0, 3.0, 4.0]
    back = table_to_records(table)
    assert back == records
    assert all(r.embedding.dtype == np.float32 and r.embedding.ndim == 1 for r in back)


def test_records_to_table_of_no_records_is_an_empty_table_of_the_schema() -> None:
    table = records_to_table([])
    assert table.num_rows == 0 and table.schema.equals(PARQUET_SCHEMA)
    assert read_parquet_bytes(write_parquet_bytes([])) == []


def test_merge_streams_parts_into_one_file_in_order(tmp_path) -> None:
    parts = [[record(f"doc{p}", i, f"c{p}.{i}", {"part": p}) for i in range(n)] for p, n in enumerate((3, 0, 5))]
    parts.append([record("doc3", 0, None, None)])
    read: list[int] = []

    def part_bytes() -> Iterator[bytes]:  # a generator, as a caller reading parts from S3 would pass
        for index, part in enumerate(parts):
            read.append(index)
            yield write_parquet_bytes(part)

    with open(tmp_path / "merged.parquet", "wb") as sink:
        rows = merge_parquet_parts(part_bytes(), sink)
    assert rows == 9 and read == [0, 1, 2, 3]
    merged = pq.ParquetFile(tmp_path / "merged.parquet")
    assert merged.schema_arrow.equals(PARQUET_SCHEMA)
    assert merged.metadata.num_row_groups >= 3  # each non-empty part became row groups of its own
    assert table_to_records(merged.read()) == [r for part in parts for r in part]


def test_merge_of_no_parts_is_a_valid_empty_file() -> None:
    sink = io.BytesIO()
    assert merge_parquet_parts([], sink) == 0
    assert pq.read_table(pa.BufferReader(sink.getvalue())).num_rows == 0


def test_merge_refuses_a_part_of_another_layout() -> None:
    other = pa.BufferOutputStream()
    pq.write_table(pa.table({"doc_id": ["a"]}), other)
    with pytest.raises(ValueError, match="not a RAG chunk table"):
        merge_parquet_parts([bytes(other.getvalue())], io.BytesIO())


# --- Options ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"chunk_tokens": 0}, "chunk_tokens must be positive"),
        ({"chunk_tokens": "254"}, "chunk_tokens must be an integer"),
        ({"overlap_tokens": 254}, "overlap_tokens must be at least 0 and less than chunk_tokens"),
        ({"overlap_tokens": -1}, "overlap_tokens must be at least 0"),
        ({"context_max_tokens": 0}, "context_max_tokens must be between 1 and"),
        ({"context_max_tokens": True}, "context_max_tokens must be an integer"),
        ({"contextualize": "yes"}, "contextualize must be true or false"),
        ({"embedding_model": " "}, "embedding_model must be a non-empty string"),
        ({"context_prompt": "Situate {chunk}."}, r"must contain \{document\} and \{chunk\}; missing: \['document'\]"),
        ({"context_prompt": "{document} {chunk} {title}"}, r"may only use .* found \['title'\]"),
        ({"context_prompt": "{document} {chunk} as JSON {"}, "not a valid template"),
    ],
)
def test_options_validation(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RagOptions(**changes)


def test_options_json_round_trip_and_unknown_fields() -> None:
    options = RagOptions(chunk_tokens=128, contextualize=True, context_prompt="{{x}} {document} / {chunk}")
    assert RagOptions.from_json(options.to_json()) == options
    assert RagOptions.from_json({}) == RagOptions()
    with pytest.raises(ValueError, match=r"unknown RAG options \['chunk_size'\]"):
        RagOptions.from_json({"chunk_size": 100})


def test_fingerprint_is_stable_and_changes_with_every_setting_that_changes_output() -> None:
    base = RagOptions(contextualize=True)
    fingerprint = base.fingerprint("smollm2")
    assert RagOptions.from_json(base.to_json()).fingerprint("smollm2") == fingerprint
    assert len(fingerprint) == 64
    variants = [
        RagOptions(contextualize=True, chunk_tokens=200),
        RagOptions(contextualize=True, overlap_tokens=0),
        RagOptions(contextualize=True, embedding_model="/models/bge-small"),
        RagOptions(contextualize=True, context_max_tokens=50),
        RagOptions(contextualize=True, context_prompt=DEFAULT_CONTEXT_PROMPT + " Be brief."),
        RagOptions(contextualize=False),
    ]
    fingerprints = {v.fingerprint("smollm2") for v in variants} | {base.fingerprint("qwen3"), fingerprint}
    assert len(fingerprints) == len(variants) + 2
    # Without contextualizing, the generation settings make no difference to the output, nor to the fingerprint.
    plain = RagOptions()
    assert plain.fingerprint("smollm2") == plain.fingerprint("qwen3")
    assert RagOptions(context_max_tokens=50).fingerprint("smollm2") == plain.fingerprint("smollm2")


def test_document_cache_key_depends_on_fingerprint_and_text() -> None:
    key = document_cache_key("f" * 64, "text")
    assert key == document_cache_key("f" * 64, "text")
    assert len({key, document_cache_key("e" * 64, "text"), document_cache_key("f" * 64, "text.")}) == 3


# --- Processing and the cache --------------------------------------------------------------------------------------


@pytest.fixture()
def cache(object_store: ObjectStore) -> ObjectStorePassageCache:
    return ObjectStorePassageCache(object_store, rag_cache_prefix(f"proj-{secrets.token_hex(4)}"))


def make_processor(
    splitter: TextSplitter, embed: CountingEmbedder, cache: ObjectStorePassageCache | None,
    options: RagOptions = SMALL_CHUNKS, contexts: NumberedContexts | None = None,
) -> DocumentProcessor:
    return DocumentProcessor(options, splitter, embed, contexts, cache, generation_model=DEFAULT_MODEL)


def test_records_are_the_splitters_chunks_with_their_embeddings(splitter: TextSplitter) -> None:
    embed = CountingEmbedder()
    text = article(1)
    records = make_processor(splitter, embed, cache=None).process("doc-1", text, {"source": "test"})

    chunks = splitter.with_config(SplitterConfig(48, 8)).split(text)
    assert len(records) == len(chunks) > 2
    for rec, chunk in zip(records, chunks):
        assert (rec.doc_id, rec.chunk_index, rec.text, rec.context) == ("doc-1", chunk.index, chunk.text, None)
        assert (rec.char_start, rec.char_end, rec.token_count) == (chunk.char_start, chunk.char_end, chunk.token_count)
        assert text[rec.char_start : rec.char_end] == rec.text
        assert rec.metadata == {"source": "test"}
        np.testing.assert_array_equal(rec.embedding, _hash_vector(chunk.text))


def test_a_second_run_of_the_same_document_comes_from_the_cache(
    splitter: TextSplitter, cache: ObjectStorePassageCache
) -> None:
    contexts = NumberedContexts()
    options = RagOptions(chunk_tokens=48, overlap_tokens=8, contextualize=True)
    first_embed, second_embed = CountingEmbedder(), CountingEmbedder()
    first = make_processor(splitter, first_embed, cache, options, contexts)
    records = first.process("doc-1", article(1), {"v": 1})
    assert first.stats.chunks_embedded == len(records) and first.stats.contexts_generated == len(records)
    assert records[0].context == "From # Report 1, part 0."

    second = make_processor(splitter, second_embed, cache, options, contexts)
    again = second.process("doc-1", article(1), {"v": 1})
    assert again == records
    assert second_embed.calls == [] and len(contexts.calls) == 1
    assert (second.stats.chunks_embedded, second.stats.contexts_generated, second.stats.documents_from_cache) == (0, 0, 1)
    assert second.stats.chunks == len(records)

    # Id and metadata are the current call's: the same text under another id is still a hit.
    renamed = second.process("doc-1-copy", article(1), None)
    assert {(r.doc_id, r.metadata) for r in renamed} == {("doc-1-copy", None)}
    assert second.stats.documents_from_cache == 2 and second_embed.calls == []


def test_only_the_changed_document_is_recomputed(splitter: TextSplitter, cache: ObjectStorePassageCache) -> None:
    documents = [(f"doc-{i}", article(i), None) for i in range(4)]
    first_embed = CountingEmbedder()
    first = make_processor(splitter, first_embed, cache).process_many(documents)
    assert len(first_embed.calls) == 1  # every document's chunks in one embed call

    changed_text = article(2).replace("rebuild", "restore")
    documents[2] = ("doc-2", changed_text, None)
    embed = CountingEmbedder()
    processor = make_processor(splitter, embed, cache)
    second = processor.process_many(documents)

    changed_chunks = [r for r in second if r.doc_id == "doc-2"]
    assert embed.calls == [[r.text for r in changed_chunks]]
    assert processor.stats.documents_from_cache == 3 and processor.stats.chunks_embedded == len(changed_chunks)
    assert [r for r in second if r.doc_id != "doc-2"] == [r for r in first if r.doc_id != "doc-2"]
    assert [r.doc_id for r in second] == sorted(r.doc_id for r in second)  # input order


def test_other_settings_do_not_share_cache_entries(splitter: TextSplitter, cache: ObjectStorePassageCache) -> None:
    make_processor(splitter, CountingEmbedder(), cache).process("d", article(5), None)
    embed = CountingEmbedder()
    other = make_processor(splitter, embed, cache, RagOptions(chunk_tokens=64, overlap_tokens=8))
    other.process("d", article(5), None)
    assert other.stats.documents_from_cache == 0 and embed.texts_embedded > 0


def test_a_damaged_cache_entry_is_recomputed(splitter: TextSplitter, cache: ObjectStorePassageCache) -> None:
    processor = make_processor(splitter, CountingEmbedder(), cache)
    key = document_cache_key(processor.fingerprint, article(6))
    cache.store.put_bytes(f"{cache.prefix}{key}.parquet", b"not parquet")
    processor.process("d", article(6), None)
    assert processor.stats.documents_from_cache == 0
    assert cache.get(key) is not None  # overwritten with the recomputed records


def test_empty_documents_and_repeated_texts(splitter: TextSplitter) -> None:
    embed = CountingEmbedder()
    contexts = NumberedContexts()
    options = RagOptions(chunk_tokens=48, overlap_tokens=8, contextualize=True)
    processor = make_processor(splitter, embed, None, options, contexts)
    records = processor.process_many(
        [("empty", "", None), ("blank", " \n\t ", None), ("a", article(3), None), ("b", article(3), None)]
    )
    assert processor.stats.documents == 4 and {r.doc_id for r in records} == {"a", "b"}
    assert len(embed.calls) == 1 and embed.texts_embedded == len(records) // 2  # the repeated text once
    assert len(contexts.calls) == 1 and len(contexts.calls[0]) == 1
    assert [r.text for r in records if r.doc_id == "a"] == [r.text for r in records if r.doc_id == "b"]


def test_contexts_of_all_documents_are_requested_in_one_call_and_prefixed_for_embedding(splitter: TextSplitter) -> None:
    embed = CountingEmbedder()
    contexts = NumberedContexts()
    options = RagOptions(chunk_tokens=48, overlap_tokens=8, contextualize=True)
    records = make_processor(splitter, embed, None, options, contexts).process_many(
        [("a", article(7), None), ("b", article(8), None)]
    )
    assert [document for document, _ in contexts.calls[0]] == [article(7), article(8)]
    assert embed.calls == [[f"{r.context}\n\n{r.text}" for r in records]]
    assert records[-1].context.startswith("From # Report 8")


def test_contextualizing_needs_a_generator(splitter: TextSplitter) -> None:
    with pytest.raises(ValueError, match="no context generator"):
        make_processor(splitter, CountingEmbedder(), None, RagOptions(contextualize=True))


# --- The real models -----------------------------------------------------------------------------------------------


def test_embeddings_equal_the_embedders_own_output_for_the_embedded_texts(splitter: TextSplitter) -> None:
    embedder = Embedder(dtype="float32")
    options = RagOptions(chunk_tokens=48, overlap_tokens=8, contextualize=True)
    records = DocumentProcessor(options, splitter, embedder.embed, NumberedContexts(), None, DEFAULT_MODEL).process_many(
        [("a", article(9), None), ("b", article(10), None)]
    )
    expected = embedder.embed([embedding_input(r.text, r.context) for r in records]).vectors
    np.testing.assert_allclose(np.stack([r.embedding for r in records]), expected, atol=1e-6)
    # The context changes what is embedded: the raw chunk alone embeds differently.
    assert not np.allclose(embedder.embed([records[0].text]).vectors[0], records[0].embedding, atol=1e-3)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_folder) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_folder)


def test_a_long_document_is_cut_at_the_same_place_for_every_chunk(smollm2_tokenizer: Tokenizer) -> None:
    document = "\n\n".join(article(seed) for seed in range(12))
    chunks = ["The work took 4 years.", "Visitors still describe the mill as the heart of the old quarter."]
    prompts = context_prompts(smollm2_tokenizer, DEFAULT_CONTEXT_PROMPT, document, chunks, max_prompt_tokens=400)
    assert all(len(prompt) <= 400 for prompt in prompts)
    text = smollm2_tokenizer.decode(prompts[1])
    assert " […]" in text and chunks[1] in text and "Report 0" in text and "Report 11" not in text
    shared = next(i for i, (x, y) in enumerate(zip(*prompts)) if x != y)
    assert shared > 300  # the (cut) document is the common prefix
    with pytest.raises(ValueError, match="without the document"):
        context_prompts(smollm2_tokenizer, DEFAULT_CONTEXT_PROMPT, document, chunks, max_prompt_tokens=60)


@pytest.mark.slow
def test_contexts_from_the_engine_share_the_documents_prefix(splitter: TextSplitter) -> None:
    llm = LLM(dtype="float32", enable_prefix_caching=True)
    options = RagOptions(chunk_tokens=60, overlap_tokens=0, contextualize=True, context_max_tokens=16)
    document = article(11, paragraphs=4)
    assert len(splitter.with_config(SplitterConfig(60, 0)).split(document)) == 4
    with EngineLoop(llm.engine) as loop:
        generate = engine_context_generator(loop, llm.tokenizer, options.context_max_tokens, options.context_prompt)
        processor = DocumentProcessor(options, splitter, CountingEmbedder(), generate, None, llm.model_name)
        records = processor.process("doc", document, None)
        stats = loop.stats()
    assert len(records) == 4 and processor.stats.contexts_generated == 4
    assert all(isinstance(r.context, str) and r.context for r in records)
    # The other three prompts found the document's blocks in the cache, computed by the first.
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.prefix_cache_hit_tokens >= 3 * (len(llm.tokenizer.encode(document, add_special_tokens=False)) // 16 - 1) * 16
    assert not llm.engine.has_unfinished_requests()
