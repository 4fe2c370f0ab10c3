"""Property-based fuzz of batch input lines: random JSON, random nesting (to thousands of levels), random Unicode
(lone surrogates and NULs included, and bytes that are not UTF-8 at all), random sizes and numbers of every kind in
every field. Through validation (the real SmolLM2 tokenizer and the engine's admission limits) every line is
either a request or one clear error record, never an exception; through `conveyor run` (the real engine) every
non-blank line gets exactly one output line, a response or an error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.admission import AdmissionLimits
from engine.model_registry import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL
from jobs.openai_format.records import error_record
from jobs.openai_format.requests import BatchRequest, EmbeddingRequest
from jobs.openai_format.validation import BatchLineValidator, LineError
from jobs.served_models import ModelNames, process_models

ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
BODY_FIELDS = [
    "model", "messages", "prompt", "input", "max_tokens", "max_completion_tokens", "n", "best_of", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "use_beam_search", "beam_width", "length_penalty", "min_tokens", "ignore_eos",
    "stop_token_ids", "encoding_format", "dimensions", "echo", "stream", "user", "instructions", "max_output_tokens",
]  # fmt: skip
MAX_MODEL_LEN = 512
SERVED = ModelNames(process_models([DEFAULT_MODEL], DEFAULT_EMBEDDING_MODEL), {})

# Every code point, surrogates (category Cs) and NUL included.
any_text = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=40)
numbers = st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=True, allow_infinity=True)
leaves = st.none() | st.booleans() | numbers | any_text
json_values = st.recursive(
    leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4), max_leaves=12
)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer"]) | any_text,
                           "content": any_text | json_values}),
    max_size=3,
)  # fmt: skip
bodies = st.dictionaries(st.sampled_from(BODY_FIELDS), json_values, max_size=6).flatmap(
    lambda body: st.fixed_dictionaries({"messages": messages, "prompt": any_text | json_values}).map(
        lambda extra: {**extra, **body}
    )
)
request_lines = st.fixed_dictionaries(
    {
        "custom_id": any_text | json_values,
        "method": st.just("POST") | json_values,
        "url": st.sampled_from(ENDPOINTS) | json_values,
        "body": bodies | json_values,
    }
)


def encode(value: Any, ascii_only: bool) -> bytes:
    """JSON text as bytes; with raw surrogates ("surrogatepass") the bytes are not valid UTF-8."""
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def deep(depth: int, opener: str) -> bytes:
    closer = {"[": "]", "{\"a\":": "}"}[opener]
    return ('{"custom_id": "deep", "method": "POST", "url": "/v1/completions", "body": {"prompt": '
            + opener * depth + "1" + closer * depth + "}}").encode()  # fmt: skip


lines = st.one_of(
    st.tuples(request_lines, st.booleans()).map(lambda args: encode(*args)),
    st.tuples(json_values, st.booleans()).map(lambda args: encode(*args)),
    st.tuples(st.integers(1, 200_000), st.sampled_from(["[", '{"a":'])).map(lambda args: deep(*args)),
    st.binary(max_size=64),
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_folder: Path):  # type: ignore[no-untyped-def]
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_folder(smollm2_folder)


def limits() -> AdmissionLimits:
    return AdmissionLimits(
        max_sequences_per_request=128,
        max_model_len=MAX_MODEL_LEN,
        max_tokens_limit=None,
        default_max_tokens=None,
        num_kv_blocks=256,
        block_size=16,
        max_blocks_per_sequence=None,
        max_prefill_tokens=None,
    )


def assert_answered(result: object) -> None:
    assert isinstance(result, (BatchRequest, EmbeddingRequest, LineError)), result
    if isinstance(result, LineError):
        record = json.loads(error_record(result).model_dump_json())
        assert record["response"] is None and record["error"]["message"]
    elif isinstance(result, BatchRequest):
        assert all(0 < len(prompt) < MAX_MODEL_LEN for prompt in result.prompts)
        assert result.sampling_params.num_sequences <= 128


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(lines, min_size=1, max_size=5))
def test_validation_answers_every_line_whatever_it_holds(tokenizer, batch: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    validator = BatchLineValidator(tokenizer, MAX_MODEL_LEN, models=SERVED, limits=limits())
    for line in batch:
        assert_answered(validator.validate(line))


@pytest.mark.parametrize(
    "line, code",
    [
        (deep(100_000, "["), "invalid_line"),
        (b'{"custom_id": "\\ud800", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}', "invalid_line"),
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\\udfff x"}}', "invalid_line"),
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "n": 100000}}',
         "request_too_large"),
    ],
    ids=["nested", "surrogate-custom-id", "surrogate-prompt", "huge-n"],
)
def test_each_poison_class_is_one_clear_line_error(tokenizer, line: bytes, code: str) -> None:  # type: ignore[no-untyped-def]
    result = BatchLineValidator(tokenizer, MAX_MODEL_LEN, models=SERVED, limits=limits()).validate(line)
    assert isinstance(result, LineError) and result.code == code, result
    assert_answered(result)


@pytest.fixture(scope="module")
def llm():  # type: ignore[no-untyped-def]
    from engine import LLM

    # Lines without max_tokens get 2 tokens, any larger request is refused: the fuzz checks answers, not lengths.
    return LLM(dtype="float32", default_max_tokens=2, max_tokens_limit=4, max_model_len=MAX_MODEL_LEN)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(lines | st.tuples(st.text(max_size=20)).map(
    lambda t: json.dumps({"custom_id": t[0], "method": "POST", "url": "/v1/completions",
                          "body": {"prompt": t[0] or "x", "temperature": 0}}).encode()), min_size=1, max_size=12))  # fmt: skip
def test_conveyor_run_answers_every_line_whatever_it_holds(llm, tmp_path_factory, batch: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    from conveyor.run_file import run_batch_file

    folder = tmp_path_factory.mktemp("fuzz")
    source, target = folder / "in.jsonl", folder / "out.jsonl"
    lines_without_newlines = [line.replace(b"\n", b" ").replace(b"\r", b" ") for line in batch]
    source.write_bytes(b"\n".join(lines_without_newlines) + b"\n")
    summary = run_batch_file(source, target, llm, progress=False, models=SERVED)
    expected = sum(1 for line in lines_without_newlines if line.strip())
    output = [json.loads(line) for line in target.read_bytes().splitlines()]
    assert len(output) == summary.total == expected
    for record in output:
        assert (record["response"] is None) != (record["error"] is None), record


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(line=lines | st.tuples(st.fixed_dictionaries({"id": any_text | json_values, "text": any_text | json_values,
                                                      "uri": any_text | json_values}), st.booleans()).map(
    lambda args: encode(*args)))  # fmt: skip
def test_a_rag_document_line_is_a_document_or_one_clear_error(line: bytes) -> None:
    from jobs.rag.documents import DocumentError, SourceDocument, parse_document_line

    try:
        assert isinstance(parse_document_line(line), SourceDocument)
    except DocumentError as error:
        assert str(error)
