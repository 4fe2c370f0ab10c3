"""The embeddings kind: OpenAI batch lines for `/v1/embeddings`, answered by the worker's embedding model.

All of a chunk's texts go to the embedder in one call, so it packs batches across lines. That call cannot be
aborted midway: a stopped batch's embeddings chunk that has started runs to its end and its results are reported.
If the shared call raises, each line is embedded alone, so the line that broke it fails alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jobs.batch_limits import BatchLimits
from jobs.models import Batch
from jobs.openai_format.records import TextEmbedder, embedding_records, error_record
from jobs.openai_format.requests import EmbeddingRequest
from jobs.openai_format.responses import BatchOutputLine
from jobs.openai_format.validation import LineError
from jobs.run.kinds import ChunkResult, EngineHandle
from jobs.run.openai_lines import OpenAILinesKind, records_result
from jobs.run.split import LineNumber
from jobs.storage import ObjectStore

log = logging.getLogger(__name__)


class EmbeddingsKind(OpenAILinesKind):
    def __init__(
        self, engine: EngineHandle, store: ObjectStore, embedder: TextEmbedder, per_chunk: int, limits: BatchLimits
    ) -> None:
        super().__init__(engine, store, per_chunk, limits)
        self.embedder = embedder

    def run_chunk(self, batch: Batch, chunk_index: int, lines: Sequence[tuple[LineNumber, bytes]]) -> ChunkResult:
        records, checked = self.checked_lines(batch, lines)
        requests: list[EmbeddingRequest] = []
        for _, request in checked:
            assert isinstance(request, EmbeddingRequest)  # the batch's endpoint embeds
            requests.append(request)
        if requests:
            records += self._embedded(requests)
        return records_result(records)

    def _embedded(self, requests: list[EmbeddingRequest]) -> list[BatchOutputLine]:
        try:
            return embedding_records(requests, self.embedder)
        except Exception:
            log.exception("embedding %d lines together failed; embedding each alone", len(requests))
        records: list[BatchOutputLine] = []
        for request in requests:
            try:
                records += embedding_records([request], self.embedder)
            except Exception as failed:
                message = f"embedding failed: {type(failed).__name__}: {failed}"
                records.append(error_record(LineError(request.custom_id, "generation_failed", message)))
        return records
