"""Contextual retrieval's cost: a context for every chunk, with the engine's prefix caching off vs on.

Workload: `--documents` synthetic reports (`bench/rag_corpus.py`, seeded) of `--doc-tokens` tokens of the
generation model each, split by the embedding model's splitter into chunks of `--chunk-tokens`; `--chunks` chunks
in all, taken evenly from the documents. Every chunk's prompt is `DEFAULT_CONTEXT_PROMPT` (the whole document,
then the chunk) in the chat template; greedy, `--max-tokens` each, through `EngineLoop` and
`jobs.rag.contextualize.engine_context_generator`, all documents in one call, as a RAG job runs them. Two runs,
identical but for prefix caching off / on: with it, a document's prompt prefix is computed once for all its chunks.

    python -m bench.rag_contextualize --documents 5 --chunks 200 --doc-tokens 3000 --max-tokens 48
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from bench.common import add_model_arguments, describe, load, markdown_table, ratio, run_cli, setup_torch
from bench.rag_corpus import synthetic_document
from engine import EngineLoop
from engine.tokenizer import Tokenizer
from jobs.rag.contextualize import engine_context_generator
from jobs.rag.processing import DEFAULT_CONTEXT_PROMPT
from jobs.rag.splitter import SplitterConfig, TextSplitter

TARGET_THROUGHPUT_GAIN = 3.0

Workload = list[tuple[str, list[str]]]  # (document, the chunks to contextualize)


@dataclass(frozen=True)
class ContextRun:
    name: str
    seconds: float
    chunks: int
    prefill_tokens_computed: int
    prefix_cache_hit_rate: float

    @property
    def chunks_per_second(self) -> float:
        return self.chunks / self.seconds


def build_workload(args: argparse.Namespace, tokenizer: Tokenizer) -> Workload:
    """(document, its chunks) pairs: `args.chunks` chunks in all, as evenly spread over the documents as they allow."""
    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    documents = [synthetic_document(args.seed + i, count_tokens, args.doc_tokens) for i in range(args.documents)]
    splitter = TextSplitter.for_embedding_model(config=SplitterConfig(args.chunk_tokens, args.overlap_tokens))
    chunks = [[chunk.text for chunk in splitter.split(document)] for document in documents]
    taken: list[list[str]] = [[] for _ in documents]
    for position in range(max(map(len, chunks))):  # round robin: chunk 0 of every document, then chunk 1, ...
        for index, document_chunks in enumerate(chunks):
            if position < len(document_chunks) and sum(map(len, taken)) < args.chunks:
                taken[index].append(document_chunks[position])
    if sum(map(len, taken)) < args.chunks:
        raise SystemExit(f"the documents have only {sum(map(len, taken))} chunks; raise --doc-tokens")
    return list(zip(documents, taken))


def run_contexts(args: argparse.Namespace, caching: bool, workload: Workload | None) -> tuple[ContextRun, Workload]:
    """One run on a fresh engine; the workload is built (with its tokenizer) on the first."""
    llm = load(args, enable_prefix_caching=caching)
    if workload is None:
        workload = build_workload(args, llm.tokenizer)
        print(
            describe(
                args, llm, documents=len(workload), chunks=sum(len(c) for _, c in workload),
                doc_tokens=args.doc_tokens, chunk_tokens=args.chunk_tokens, max_tokens=args.max_tokens,
            ),
            flush=True,
        )
    with EngineLoop(llm.engine) as loop:
        generate = engine_context_generator(loop, llm.tokenizer, args.max_tokens, DEFAULT_CONTEXT_PROMPT)
        generate([("Warm-up document.", ["Warm-up chunk."])])
        before = loop.stats()
        start = time.perf_counter()
        contexts = generate(workload)
        seconds = time.perf_counter() - start
        after = loop.stats()
    queried = after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    run = ContextRun(
        name="on" if caching else "off",
        seconds=seconds,
        chunks=sum(map(len, contexts)),
        prefill_tokens_computed=after.counters.prompt_tokens_computed - before.counters.prompt_tokens_computed,
        prefix_cache_hit_rate=hits / max(1, queried),
    )
    print(f"prefix caching {run.name}: {run.seconds:.1f} s; first context: {contexts[0][0]!r}", flush=True)
    return run, workload


def format_table(runs: list[ContextRun], baseline: ContextRun) -> str:
    headers = ["prefix caching", "chunks", "wall s", "chunks/s", "prefill tok computed", "hit rate",
               "prefill reduction vs off", "chunks/s vs off"]
    rows = [
        [
            r.name, r.chunks, f"{r.seconds:.1f}", f"{r.chunks_per_second:.2f}", r.prefill_tokens_computed,
            f"{r.prefix_cache_hit_rate:.1%}", ratio(baseline.prefill_tokens_computed, r.prefill_tokens_computed),
            ratio(r.chunks_per_second, baseline.chunks_per_second),
        ]
        for r in runs
    ]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--documents", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=200, help="chunks contextualized, over all documents")
    parser.add_argument("--doc-tokens", type=int, default=3000, help="generation-model tokens per document")
    parser.add_argument("--chunk-tokens", type=int, default=64, help="embedding-model tokens per chunk")
    parser.add_argument("--overlap-tokens", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens generated per context")


def run(args: argparse.Namespace) -> None:
    setup_torch(args)
    off, workload = run_contexts(args, caching=False, workload=None)
    on, _ = run_contexts(args, caching=True, workload=workload)
    print()
    print(format_table([off, on], baseline=off))
    print()
    gain = on.chunks_per_second / off.chunks_per_second
    print(f"throughput (chunks/s), on / off: {gain:.2f}x (target >= {TARGET_THROUGHPUT_GAIN:g}x): "
          f"{'met' if gain >= TARGET_THROUGHPUT_GAIN else 'NOT met'}")


if __name__ == "__main__":
    main()
