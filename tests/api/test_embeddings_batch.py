"""An /v1/embeddings batch through the whole service, driven by the `openai` SDK: the shared stack's API and worker
(which loads the embedding model on this batch's first chunk), PostgreSQL, Redis and SeaweedFS."""

from __future__ import annotations

import base64
from collections import Counter
from typing import Any

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse

from engine.embedder import Embedder
from tests.api.test_batch_service import client_for, jsonl, read_jsonl, wait_for
from tests.stack_fixtures import Stack

pytestmark = pytest.mark.slow

EMBEDDINGS = "/v1/embeddings"


def embedding_line(custom_id: str, **body: Any) -> dict[str, Any]:
    body = {"model": "all-minilm-l6-v2", **body}
    return {"custom_id": custom_id, "method": "POST", "url": EMBEDDINGS, "body": body}


def test_an_embeddings_batch_answers_like_openai_with_the_embedders_vectors(stack: Stack) -> None:
    client = client_for(stack, stack.new_key("embeddings-project"))
    topics = ["cats", "ships", "rain", "jazz", "bread", "glaciers", "chess", "tea"]
    good = [embedding_line(f"one-{i}", input=f"Sentence number {i} is about {topics[i % 8]}.") for i in range(20)]
    good += [
        embedding_line("list", input=["first passage of a document", "second passage", "third"]),
        embedding_line("base64", input=["decode me", "and me"], encoding_format="base64"),
        embedding_line("floats-explicit", input="explicit float format", encoding_format="float", user="u-7"),
        embedding_line("same-dimensions", input="dimensions equal to the model's", dimensions=384),
        embedding_line("long", input="a very long passage " * 400),  # truncated to max_seq_length, not refused
        embedding_line("unicode", input=["naïve café — 東京", "emoji 🙂 text"]),
    ]
    bad: list[tuple[dict[str, Any] | str, str | None, str]] = [
        (embedding_line("empty-list", input=[]), "empty-list", "invalid_parameter"),
        (embedding_line("empty-text", input=["ok", ""]), "empty-text", "invalid_body"),
        (embedding_line("token-ids", input=[101, 7592, 102]), "token-ids", "invalid_body"),
        (embedding_line("other-dimensions", input="x", dimensions=256), "other-dimensions", "invalid_parameter"),
        ({**embedding_line("wrong-url", input="x"), "url": "/v1/completions"}, "wrong-url", "mismatched_endpoint"),
        ("{not json", None, "invalid_json_line"),
        (embedding_line("one-0", input="a duplicate custom_id"), "one-0", "duplicate_custom_id"),
    ]
    lines: list[dict[str, Any] | str] = list(good)
    for position, (line, _, _) in enumerate(bad):  # spread through the file: both chunks (chunk_size 16) get some
        lines.insert(position * 5 + 1, line)
    batch_input = client.files.create(file=("embeddings.jsonl", jsonl(lines)), purpose="batch")

    batch = client.batches.create(input_file_id=batch_input.id, endpoint=EMBEDDINGS, completion_window="24h")
    assert batch.endpoint == EMBEDDINGS
    done = wait_for(client, batch.id)

    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        len(good) + len(bad), len(good), len(bad)
    )
    errors = read_jsonl(client, done.error_file_id)
    assert Counter(line["error"]["code"] for line in errors) == Counter(code for _, _, code in bad)
    unambiguous = {custom_id: code for _, custom_id, code in bad if custom_id not in (None, "one-0")}
    assert {line["custom_id"]: line["error"]["code"] for line in errors if line["custom_id"] in unambiguous} == (
        unambiguous
    )
    dimensions_error = next(line["error"] for line in errors if line["custom_id"] == "other-dimensions")
    assert "dimensions=256 is not supported" in dimensions_error["message"]

    output_lines = read_jsonl(client, done.output_file_id)
    assert Counter(line["custom_id"] for line in output_lines) == Counter(line["custom_id"] for line in good)
    outputs = {line["custom_id"]: line for line in output_lines}
    # The worker's model, as it builds it (same dtype and device defaults), embedding the same texts.
    embedder = Embedder(stack.settings.embedding_model, dtype=stack.settings.dtype, device=stack.settings.device)
    for line in good:
        record = outputs[line["custom_id"]]
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        if line["body"].get("encoding_format") == "base64":  # decoded as the SDK decodes it, into the same floats
            for item in body["data"]:
                assert isinstance(item["embedding"], str)
                item["embedding"] = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist()
        response = CreateEmbeddingResponse.model_validate(body)  # the SDK's own type for POST /v1/embeddings
        assert response.object == "list" and response.model == stack.settings.embedding_model
        texts = line["body"]["input"] if isinstance(line["body"]["input"], list) else [line["body"]["input"]]
        expected = embedder.embed(texts)
        assert [(item.object, item.index) for item in response.data] == [("embedding", i) for i in range(len(texts))]
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(expected.token_counts)
        vectors = np.array([item.embedding for item in response.data], dtype=np.float32)
        assert vectors.shape == (len(texts), embedder.dimension)
        cosine = np.sum(vectors * expected.vectors, axis=1) / (
            np.linalg.norm(vectors, axis=1) * np.linalg.norm(expected.vectors, axis=1)
        )
        assert cosine.min() >= 0.9999, (line["custom_id"], cosine)
    assert outputs["long"]["response"]["body"]["usage"]["prompt_tokens"] == embedder.max_seq_length
