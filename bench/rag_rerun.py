"""Re-running a RAG job on a corpus that barely changed: the per-document cache against computing everything.

Workload: `--documents` synthetic reports (`bench/rag_corpus.py`, seeded) of `--doc-tokens` embedding-model tokens,
processed by one `DocumentProcessor.process_many` call with `RagOptions` defaults (254-token chunks, embeddings
only unless `--contextualize`) and an `ObjectStorePassageCache` on a private SeaweedFS server. Then the corpus
with `--changed-percent` of its documents edited (a sentence appended) is processed again with the same cache: the
unchanged documents are cache hits (one GET each, no splitting, no embedding, no contexts), the edited ones are
split and computed again.

    python -m bench.rag_rerun --documents 200 --doc-tokens 1500 --changed-percent 1
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

from bench.common import add_model_arguments, load, markdown_table, ratio, run_cli, setup_torch
from bench.rag_corpus import changed_document, synthetic_document
from conveyor.seaweedfs import SeaweedFS
from engine import EngineLoop
from engine.embedder import Embedder
from engine.model_registry import DEFAULT_MODEL
from jobs.object_keys import rag_cache_prefix
from jobs.rag.contextualize import engine_context_generator
from jobs.rag.processing import (
    ContextGenerator,
    DocumentInput,
    DocumentProcessor,
    ObjectStorePassageCache,
    ProcessingStats,
    RagOptions,
)
from jobs.rag.splitter import TextSplitter
from jobs.settings import S3Settings
from jobs.storage import ObjectStore

TARGET_SPEEDUP = 10.0


@dataclass(frozen=True)
class RerunRun:
    name: str
    seconds: float
    stats: ProcessingStats


def build_corpus(args: argparse.Namespace, splitter: TextSplitter) -> tuple[list[DocumentInput], list[DocumentInput]]:
    """The corpus, and the same corpus with `--changed-percent` of its documents (at least one) edited."""
    corpus = [
        (f"doc-{i:05d}", synthetic_document(args.seed + i, splitter.count_tokens, args.doc_tokens), {"n": i})
        for i in range(args.documents)
    ]
    changed_count = max(1, math.ceil(args.documents * args.changed_percent / 100))
    stride = args.documents // changed_count  # spread over the corpus rather than all at its start
    edited = list(corpus)
    for index in range(0, stride * changed_count, stride):
        doc_id, text, metadata = corpus[index]
        edited[index] = (doc_id, changed_document(text, args.seed + index), metadata)
    return corpus, edited


@contextmanager
def object_store() -> Iterator[ObjectStore]:
    """A bucket on a private SeaweedFS server, gone after the run."""
    with tempfile.TemporaryDirectory(prefix="rag-rerun-") as folder:
        access_key, secret_key = f"BENCH{secrets.token_hex(8).upper()}", secrets.token_hex(20)
        credentials = {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
        # boto3 reads credentials from the environment; the settings never carry them.
        with SeaweedFS(Path(folder), access_key=access_key, secret_key=secret_key) as server, patch.dict(
            os.environ, credentials
        ):
            store = ObjectStore(S3Settings(endpoint_url=server.endpoint_url, bucket="rag-rerun"))
            store.ensure_bucket()
            yield store


@contextmanager
def context_generator(args: argparse.Namespace, options: RagOptions) -> Iterator[tuple[ContextGenerator | None, str]]:
    """The engine's context generator and its model's name when contextualizing; nothing to load otherwise."""
    if not options.contextualize:
        yield None, DEFAULT_MODEL
        return
    llm = load(args, enable_prefix_caching=True)
    with EngineLoop(llm.engine) as loop:
        yield engine_context_generator(loop, llm.tokenizer, options.context_max_tokens, options.context_prompt), llm.model_name


def timed_run(name: str, processor: DocumentProcessor, documents: list[DocumentInput]) -> RerunRun:
    start = time.perf_counter()
    processor.process_many(documents)
    run = RerunRun(name, time.perf_counter() - start, processor.stats)
    print(f"{name}: {run.seconds:.1f} s", flush=True)
    return run


def format_table(runs: list[RerunRun], baseline: RerunRun) -> str:
    headers = ["run", "documents", "from cache", "chunks", "chunks embedded", "contexts generated",
               "embedding s", "context s", "wall s", "speedup"]
    rows = [
        [
            r.name, r.stats.documents, r.stats.documents_from_cache, r.stats.chunks, r.stats.chunks_embedded,
            r.stats.contexts_generated, f"{r.stats.embedding_seconds:.1f}", f"{r.stats.context_seconds:.1f}",
            f"{r.seconds:.2f}", ratio(baseline.seconds, r.seconds),
        ]
        for r in runs
    ]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)  # the generation model, used with --contextualize
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--doc-tokens", type=int, default=1500, help="embedding-model tokens per document")
    parser.add_argument("--changed-percent", type=float, default=1.0, help="documents edited before the re-run")
    parser.add_argument("--contextualize", action="store_true", help="also generate a context for every chunk")
    parser.add_argument("--embedding-dtype", default="auto")


def run(args: argparse.Namespace) -> None:
    setup_torch(args)
    options = RagOptions(contextualize=args.contextualize)
    splitter = TextSplitter.for_embedding_model(options.embedding_model)
    corpus, edited = build_corpus(args, splitter)
    embedder = Embedder(options.embedding_model, dtype=args.embedding_dtype)
    embedder.embed(["warm-up"])
    print(
        f"documents={len(corpus)} doc-tokens={args.doc_tokens} changed={sum(a != b for a, b in zip(corpus, edited))} "
        f"contextualize={options.contextualize} embedding-dtype={embedder.dtype}",
        flush=True,
    )
    with object_store() as store, context_generator(args, options) as (generate, generation_model):
        cache = ObjectStorePassageCache(store, rag_cache_prefix("bench"))

        def processor() -> DocumentProcessor:
            return DocumentProcessor(options, splitter, embedder.embed, generate, cache, generation_model)

        first = timed_run("first run", processor(), corpus)
        rerun = timed_run("re-run, edited corpus", processor(), edited)
    print()
    print(format_table([first, rerun], baseline=first))
    print()
    speedup = first.seconds / rerun.seconds
    print(f"re-run speedup: {speedup:.1f}x (target >= {TARGET_SPEEDUP:g}x): {'met' if speedup >= TARGET_SPEEDUP else 'NOT met'}")


if __name__ == "__main__":
    main()
