"""Embedding throughput: the engine's `Embedder` vs sentence-transformers' `encode`, same model, device, dtype.

Workload: `--num-chunks` chunks of English-like text, each of a length drawn uniformly from
[`--min-tokens`, `--max-tokens`] tokens (special tokens included), in random order, like the chunks of a
RAG preprocessing job. Both sides get all chunks in one call after a warm-up call:

  conveyor               `Embedder.embed`: sorted by length and packed without padding into batches of
                         `--max-batch-tokens` tokens
  sentence-transformers  `SentenceTransformer(folder).encode(batch_size=--batch-size)`: sorted by length,
                         padded to the longest text of each batch

Prints chunks/s and tokens/s of each, the ratio, and the lowest cosine similarity between the two
sides' vectors for the same chunk (they should agree to float rounding).

    python -m bench.embeddings --num-chunks 2000 --device cpu --dtype auto
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.common import markdown_table, ratio, run_cli
from engine import Embedder
from engine.config import EmbedderConfig
from engine.model_registry import DEFAULT_EMBEDDING_MODEL, resolve_embedding_model

TARGET_SPEEDUP = 2.0
_WARMUP_CHUNKS = 8

# Common words, each one WordPiece token for BERT-family vocabularies, so a chunk's length in tokens is
# its word count plus its [CLS]/[SEP].
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which have are be not had "
    "one all were when there been has their more would first new who will about time after into only other "
    "two over years most also made city between state school year under world during where such later "
    "team house three government found part both since group known several people second music united "
    "film while general life national including well work left area four before early south north family "
    "water series called number name war public major held released river through company while back"
).split()


def make_chunks(num_chunks: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    chunks = []
    for _ in range(num_chunks):
        words = rng.randint(min_tokens, max_tokens) - 2  # the tokenizer adds [CLS] and [SEP]
        chunks.append(" ".join(rng.choice(_WORDS) for _ in range(max(words, 1))))
    return chunks


def timed(embed: Callable[[list[str]], np.ndarray], chunks: list[str]) -> tuple[float, np.ndarray]:
    embed(chunks[:_WARMUP_CHUNKS])
    start = time.perf_counter()
    vectors = embed(chunks)
    return time.perf_counter() - start, vectors


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_EMBEDDING_MODEL)
    parser.add_argument("--dtype", default="auto", help="both sides; auto: bfloat16 where it is fast, else float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice, the core count)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-chunks", type=int, default=2000)
    parser.add_argument("--min-tokens", type=int, default=16, help="shortest chunk, special tokens included")
    parser.add_argument("--max-tokens", type=int, default=256, help="longest chunk, special tokens included")
    parser.add_argument("--batch-size", type=int, default=64, help="sentence-transformers' texts per batch")
    parser.add_argument("--max-batch-tokens", type=int, default=EmbedderConfig.max_batch_tokens,
                        help="the Embedder's tokens per packed batch")


def run(args: argparse.Namespace) -> None:
    from sentence_transformers import SentenceTransformer  # a test-only dependency

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    chunks = make_chunks(args.num_chunks, args.min_tokens, args.max_tokens, args.seed)
    embedder = Embedder(args.model, dtype=args.dtype, device=args.device,
                        config=EmbedderConfig(max_batch_tokens=args.max_batch_tokens))
    reference = SentenceTransformer(str(resolve_embedding_model(args.model)), device=args.device)
    reference.to(embedder.dtype)
    token_counts = [len(ids) for ids in embedder.tokenize(chunks)]
    dtype = str(embedder.dtype).removeprefix("torch.")
    print(
        f"model={args.model} dtype={dtype} device={args.device} chunks={len(chunks)} "
        f"tokens={min(token_counts)}-{max(token_counts)} (mean {np.mean(token_counts):.0f}) "
        f"batch-size={args.batch_size} max-batch-tokens={args.max_batch_tokens} threads={torch.get_num_threads()}",
        flush=True,
    )

    ours_seconds, ours = timed(lambda texts: embedder.embed(texts).vectors, chunks)
    print(f"conveyor: {ours_seconds:.1f} s", flush=True)
    theirs_seconds, theirs = timed(
        lambda texts: reference.encode(
            texts, batch_size=args.batch_size, convert_to_numpy=True, show_progress_bar=False
        ),
        chunks,
    )
    print(f"sentence-transformers: {theirs_seconds:.1f} s", flush=True)

    total_tokens = sum(token_counts)
    rows = [
        [name, f"{len(chunks) / seconds:.1f}", f"{total_tokens / seconds:.0f}", f"{seconds:.2f}",
         ratio(theirs_seconds, seconds)]
        for name, seconds in (("conveyor Embedder", ours_seconds), ("sentence-transformers encode", theirs_seconds))
    ]
    print()
    print(markdown_table(["engine", "chunks/s", "tokens/s", "seconds", "vs sentence-transformers"], rows))
    print()
    theirs = theirs.astype(np.float32)
    cosines = (ours * theirs).sum(axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    print(f"lowest cosine similarity between the two sides' vectors: {cosines.min():.6f}")
    speedup = theirs_seconds / ours_seconds
    verdict = "met" if speedup >= TARGET_SPEEDUP else "NOT met"
    print(f"chunks/s, conveyor / sentence-transformers: {speedup:.2f}x (target >= {TARGET_SPEEDUP:g}x): {verdict}")


if __name__ == "__main__":
    main()
