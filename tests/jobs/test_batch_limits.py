"""OpenAI's limits on one batch (`jobs.batch_limits`): requests per input file and embedding inputs across an
embeddings batch, counted while validate reads the lines; the input's size, refused at creation."""

from __future__ import annotations

import json

import pytest

from jobs.batch_limits import BatchLimits, check_input_size
from jobs.errors import ServiceError
from jobs.run.openai_lines import RequestLines
from jobs.run.split import ValidationTally, split_into_chunks
from jobs.settings import Settings
from tests.jobs.test_openai_format import completion_line, validator


def refusal_after_validate(lines: list[str], limits: BatchLimits) -> tuple[str, str] | None:
    """The input read as validate reads it (every line checked, chunks cut), then judged as a whole."""
    request_lines = RequestLines(validator(), per_chunk=1000, limits=limits)
    tally = ValidationTally()
    split_into_chunks([("\n".join(lines) + "\n").encode()], request_lines, tally, lambda record: None)
    return request_lines.refusal(tally)


def embedding_line(custom_id: str, texts: list[str]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"input": texts}})


def test_a_file_of_50001_requests_fails_as_openai_fails_it() -> None:
    limits = Settings().batch_limits()  # the defaults: OpenAI's own limits
    assert limits.max_requests == 50_000
    # The shortest line a client could send: a bad one is still a request, as OpenAI counts them.
    refusal = refusal_after_validate(["{}"] * 50_001, limits)
    assert refusal is not None
    code, message = refusal
    assert code == "too_many_tasks"
    assert "50001 requests" in message and "50000" in message


def test_the_request_limit_is_a_setting_and_a_file_at_it_runs() -> None:
    limits = Settings(max_batch_requests=3).batch_limits()
    assert refusal_after_validate([completion_line(f"r{i}") for i in range(3)], limits) is None
    assert refusal_after_validate([completion_line(f"r{i}") for i in range(4)], limits) == (
        "too_many_tasks",
        "The batch input file holds 4 requests, more than the 3 a batch may hold. Please try again with a smaller "
        "batch.",
    )


def test_embedding_inputs_count_across_the_lines_of_a_batch() -> None:
    limits = Settings(max_batch_embedding_inputs=4).batch_limits()
    assert refusal_after_validate([embedding_line("a", ["x", "y"]), embedding_line("b", ["z", "w"])], limits) is None
    refusal = refusal_after_validate([embedding_line("a", ["x", "y"]), embedding_line("b", ["z", "w", "v"])], limits)
    assert refusal is not None and refusal[0] == "too_many_tasks" and "5 embedding inputs" in refusal[1]


def test_an_input_file_over_the_size_limit_is_refused_at_creation() -> None:
    default = Settings().max_batch_input_bytes
    assert default == 209_715_200  # OpenAI's 200 MB, as its own message states it
    check_input_size(default, default)
    with pytest.raises(ServiceError) as refused:
        check_input_size(default + 1, default)
    assert refused.value.kind == "invalid_request" and refused.value.param == "input_file_id"
    assert refused.value.message.startswith("The batch input file is larger than the 209715200 maximum")
