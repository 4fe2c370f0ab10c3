"""/v1/embeddings batch lines: validation, and the shape of the answers (with the real bundled embedding model)."""

from __future__ import annotations

import base64
import json
import threading
from typing import Any

import numpy as np
import pytest

from engine.embedder import Embedder
from jobs.openai_format.records import embedding_records
from jobs.openai_format.requests import COMPLETIONS, EMBEDDINGS, MAX_EMBEDDING_INPUTS, BatchRequest, EmbeddingRequest
from jobs.openai_format.validation import BatchLineValidator, LineError
from jobs.lazy_embedder import LazyEmbedder
from tests.jobs.test_openai_format import SERVED, WordTokenizer


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(dtype="float32", device="cpu")


def embedding_line(custom_id: str = "emb-1", **body: Any) -> str:
    body.setdefault("input", "the quick brown fox")
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": EMBEDDINGS, "body": body})


def validate(line: str, endpoint: str | None = EMBEDDINGS) -> EmbeddingRequest | BatchRequest | LineError:
    return BatchLineValidator(WordTokenizer(), 64, endpoint, models=SERVED).validate(line)  # type: ignore[arg-type]


def accepted(line: str) -> EmbeddingRequest:
    result = validate(line)
    assert isinstance(result, EmbeddingRequest), result
    return result


def rejected(line: str) -> LineError:
    result = validate(line)
    assert isinstance(result, LineError), result
    return result


# ---------------------------------------------------------------------------------------------------------
# Validation


def test_one_text_or_a_list_of_texts_is_accepted_and_float_is_the_default_format() -> None:
    single = accepted(embedding_line(input="hello", model="text-embedding-3-small", user="u-1"))
    assert single == EmbeddingRequest("emb-1", ["hello"], "float", None)
    several = accepted(embedding_line(input=["a", "b c"], encoding_format="base64", dimensions=384))
    assert several == EmbeddingRequest("emb-1", ["a", "b c"], "base64", 384)


@pytest.mark.parametrize(
    ("body", "code", "message_part"),
    [
        ({"input": []}, "invalid_parameter", "at least 1 item"),
        ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, "invalid_parameter", f"at most {MAX_EMBEDDING_INPUTS} items"),
        ({"input": ["fine", ""]}, "invalid_body", "input[1] is an empty string"),
        ({"input": ""}, "invalid_body", "input[0] is an empty string"),
        ({"input": [101, 2023, 102]}, "invalid_body", "token-id input is not supported"),
        ({"input": [[101, 102], [101, 103]]}, "invalid_body", "token-id input is not supported"),
        ({"input": ["text", 7]}, "invalid_body", "body.input[1]"),
        ({"input": {"text": "x"}}, "invalid_body", "body.input"),
        ({"model": "m"}, "invalid_body", "missing required parameter 'body.input'"),
        ({"input": "x", "encoding_format": "int8"}, "invalid_body", "body.encoding_format"),
        ({"input": "x", "dimensions": 0}, "invalid_parameter", "body.dimensions"),
        ({"input": "x", "dimensions": "384"}, "invalid_body", "body.dimensions"),
        ({"input": "x", "temperature": 0.5}, "invalid_body", "unsupported parameter 'body.temperature'"),
    ],
)
def test_bad_embedding_bodies_get_error_records_that_say_what_is_wrong(
    body: dict[str, Any], code: str, message_part: str
) -> None:
    line = json.dumps({"custom_id": "emb-1", "method": "POST", "url": EMBEDDINGS, "body": body})
    error = rejected(line)
    assert (error.custom_id, error.code) == ("emb-1", code)
    assert message_part in error.message


def test_embedding_lines_must_match_the_batch_endpoint() -> None:
    wrong = validate(embedding_line(input="x"), endpoint=COMPLETIONS)
    assert isinstance(wrong, LineError) and wrong.code == "mismatched_endpoint"
    assert isinstance(validate(embedding_line(input="x"), endpoint=None), EmbeddingRequest)


# ---------------------------------------------------------------------------------------------------------
# Answers


def test_float_and_base64_answers_carry_the_embedders_vectors_and_token_counts(embedder: Embedder) -> None:
    texts = ["A cat sat on the mat.", "Embeddings map text to vectors.", "short"]
    requests = [
        EmbeddingRequest("floats", texts[:2], "float", None),
        EmbeddingRequest("b64", texts[2:], "base64", embedder.dimension),
    ]
    floats, packed = embedding_records(requests, embedder)
    expected = embedder.embed(texts)

    line = json.loads(floats.model_dump_json())
    assert line["custom_id"] == "floats" and line["error"] is None and line["id"].startswith("batch_req_")
    assert line["response"]["status_code"] == 200 and line["response"]["request_id"].startswith("req_")
    body = line["response"]["body"]
    assert set(body) == {"object", "data", "model", "usage"}
    assert (body["object"], body["model"]) == ("list", "all-minilm-l6-v2")
    assert [(item["object"], item["index"]) for item in body["data"]] == [("embedding", 0), ("embedding", 1)]
    vectors = np.array([item["embedding"] for item in body["data"]], dtype=np.float32)
    np.testing.assert_array_equal(vectors, expected.vectors[:2])  # JSON floats carry the float32 values exactly
    tokens = sum(expected.token_counts[:2])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    b64_body = json.loads(packed.model_dump_json())["response"]["body"]
    encoded = b64_body["data"][0]["embedding"]
    assert isinstance(encoded, str)
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")  # as the openai SDK decodes it
    np.testing.assert_array_equal(decoded, expected.vectors[2])
    assert b64_body["usage"]["prompt_tokens"] == expected.token_counts[2]


def test_texts_past_max_seq_length_are_truncated_and_usage_counts_what_was_embedded(embedder: Embedder) -> None:
    long_text = "word " * 2000
    (record,) = embedding_records([EmbeddingRequest("long", [long_text], "float", None)], embedder)
    assert record.response is not None
    assert record.response.body.usage.prompt_tokens == embedder.max_seq_length  # type: ignore[union-attr]


def test_a_dimensions_other_than_the_models_fails_only_its_line(embedder: Embedder) -> None:
    requests = [
        EmbeddingRequest("shorter", ["x"], "float", 256),
        EmbeddingRequest("fine", ["y"], "float", None),
    ]
    refused, answered = embedding_records(requests, embedder)
    assert refused.response is None and refused.error is not None
    assert refused.error.code == "invalid_parameter"
    assert "dimensions=256 is not supported" in refused.error.message and "384" in refused.error.message
    assert answered.error is None and answered.custom_id == "fine"


def test_the_lazy_embedder_builds_once_on_first_use_on_its_own_thread(embedder: Embedder) -> None:
    built_on: list[threading.Thread] = []

    def build() -> Embedder:
        built_on.append(threading.current_thread())
        return embedder

    lazy = LazyEmbedder("all-minilm-l6-v2", build)
    assert built_on == []  # nothing loads until an embeddings chunk comes
    callers = [threading.Thread(target=lazy.embed, args=([f"text {i}"],)) for i in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(built_on) == 1 and built_on[0] not in callers and built_on[0] is not threading.current_thread()
    assert lazy.dimension == embedder.dimension
    (record,) = embedding_records([EmbeddingRequest("via-lazy", ["hello"], "float", None)], lazy)
    assert record.error is None and len(built_on) == 1
