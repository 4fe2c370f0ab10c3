"""What differs between kinds of job, behind one protocol, so the pipeline never asks which kind it runs.

A kind of job is chosen by the batch's endpoint: OpenAI batch lines that generate (`/v1/chat/completions`,
`/v1/completions`: `jobs.run.generation`), OpenAI embeddings lines (`/v1/embeddings`: `jobs.run.embeddings`) and RAG
preprocessing (`/v1/rag/jobs`: `jobs.rag.kind`). Each says what its input lines are (validate's check, the error
record of a line that expired unrun), what a chunk's accepted lines turn into (`ChunkResult`: the output object's
bytes and the error records; the pipeline writes them, see `jobs.run.ledger`), and what its finished chunks
become (the output file, and any further file such as RAG's manifest). The worker wires one of each
(`jobs.worker`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from jobs.models import Batch, File
from jobs.run.split import InputLines, LineNumber
from jobs.stop_flags import StopReason

if TYPE_CHECKING:  # the API process imports no engine (nor torch)
    from engine.admission import AdmissionLimits
    from engine.engine_loop import EngineLoop
    from jobs.openai_format.requests import PromptTokenizer
    from jobs.served_models import ModelNames


@dataclass(frozen=True)
class EngineHandle:
    """The worker's one engine, as the job kinds need it."""

    loop: EngineLoop
    tokenizer: PromptTokenizer
    max_model_len: int
    model_name: str
    served: ModelNames  # what a line's `model` may name here: this worker's models, by their names and aliases
    admission_limits: AdmissionLimits  # what one request may cost the engine (engine/admission.py)


@dataclass(frozen=True)
class TokenUsage:
    """Tokens of the lines a chunk answered, as OpenAI's Batch `usage` counts them."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # of input_tokens: read from the engine's prefix cache

    def __add__(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cached_tokens + other.cached_tokens,
        )


@dataclass(frozen=True)
class ChunkResult:
    """A chunk's results, before they are written."""

    output: bytes  # the output object: JSONL lines, or a Parquet part
    errors: bytes  # the error records, JSONL
    completed: int  # lines answered
    failed: int  # lines that failed
    metadata: Mapping[str, str] = field(default_factory=dict)  # more for the output object's metadata
    usage: TokenUsage = TokenUsage()


@dataclass(frozen=True)
class FinishedChunks:
    """What finalize hands a kind: the job and its done chunks' output objects, in chunk order."""

    batch: Batch
    output_keys: list[str]
    stop_reason: StopReason | None  # why the job stopped early, if it did


class JobKind(Protocol):
    def input_lines(self, batch: Batch) -> InputLines: ...

    def run_chunk(self, batch: Batch, chunk_index: int, lines: Sequence[tuple[LineNumber, bytes]]) -> ChunkResult:
        """The chunk's accepted lines, run. Reads the batch's stop flag while it runs: what did not run when it
        was raised is left out (cancel) or gets an expiry error record (expiry)."""
        ...

    def output_file(self, finished: FinishedChunks, file_id: str) -> File:
        """The done chunks' outputs as one file (an object in the store; its row is not added)."""
        ...

    def report_files(
        self, finished: FinishedChunks, *, failed: int, output_file_id: str | None, error_file_id: str | None
    ) -> list[File]:
        """Files the job writes beside its output and error files (RAG's manifest); none for most kinds."""
        ...
