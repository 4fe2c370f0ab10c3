"""OpenAI's `/v1/embeddings`: texts in, an embedding `list` out, answered by the worker's embedding model for many
lines at once (`jobs.openai_format.records.embedding_records`), not by the engine."""

from __future__ import annotations

from typing import Any

from jobs.formats.base import LineReader, parse_body
from jobs.openai_format.requests import EMBEDDINGS, EmbeddingBody, EmbeddingRequest
from jobs.served_models import ModelKind


class Embeddings:
    url = EMBEDDINGS
    model_kind: ModelKind = "embedding"

    def read(self, custom_id: str, body: dict[str, Any], line: LineReader) -> EmbeddingRequest:
        embedding = parse_body(EmbeddingBody, body)
        line.check_model(embedding.model, "embedding")
        return EmbeddingRequest(custom_id, embedding.input, embedding.encoding_format or "float", embedding.dimensions)
