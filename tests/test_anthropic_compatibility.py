"""Every row of docs/anthropic_compatibility.md's field table, checked: what the table says conveyor does with a
Message Batch field is what it does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

from jobs.batch_limits import MessageBatchLimits
from jobs.errors import ServiceError
from jobs.message_batches import create_message_batch
from jobs.openai_format.validation import LineError
from jobs.settings import Settings
from tests.jobs.test_openai_format import validator
from tests.test_openai_compatibility import Row, assert_verdict

TABLE = Path(__file__).parents[1] / "docs" / "anthropic_compatibility.md"
BASE_PARAMS: dict[str, Any] = {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"name": "w", "input_schema": {"type": "object"}}


def rows() -> list[Row]:
    found = []
    for line in TABLE.read_text().split("## The batch object")[0].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("Endpoint", "---"):
            continue
        found.append(Row(cells[0], cells[1], json.loads(cells[2].strip("`")), cells[3], cells[4]))
    return found


def params_for(row: Row) -> dict[str, Any]:
    name = row.field.split("`")[1].split("[")[0]
    params = {**BASE_PARAMS, name: row.example}
    if name == "tool_choice":
        params["tools"] = [TOOL]
    return params


class _NoStore:
    """Creation refuses these requests before anything is stored."""

    def put_bytes(self, key: str, data: bytes) -> None:
        raise AssertionError("a refused batch stores nothing")


def outcome(row: Row) -> str | None:
    """None when accepted, else the refusal's message."""
    if row.endpoint == "messages":
        line = json.dumps({"custom_id": "row", "method": "POST", "url": "/v1/messages", "body": params_for(row)})
        checked = validator(max_model_len=512).validate(line)
        return checked.message if isinstance(checked, LineError) else None
    assert row.endpoint == "batch create", row
    example = row.example
    defaults = Settings()
    limits = MessageBatchLimits(defaults.max_message_batch_requests, defaults.max_message_batch_bytes)
    request = {"custom_id": example.get("custom_id", "r"), "params": BASE_PARAMS}
    requests = [request] * (2 if example.get("repeat") else 1)
    if "count" in example:
        requests = [{"custom_id": f"r{index}", "params": {}} for index in range(example["count"])]
    if "bytes_over_limit" in example:  # the default, 256 MB, checked the same way with a smaller limit
        limits = MessageBatchLimits(limits.max_requests, max_bytes=1000)
        requests = [{"custom_id": "big", "params": {"pad": "x" * 1000}}]
    try:
        create_message_batch(Session(), _NoStore(), "proj", requests, limits, None)  # type: ignore[arg-type]
    except ServiceError as refused:
        return refused.message
    except AssertionError:
        return None  # accepted: it went on to store the requests
    return None


def test_the_table_covers_every_verdict() -> None:
    assert {row.verdict for row in rows()} == {"honoured", "no-op", "refused"}
    assert {row.endpoint for row in rows()} == {"messages", "batch create"}


@pytest.mark.parametrize("row", rows(), ids=lambda row: f"{row.endpoint}:{row.field}:{row.verdict}")
def test_each_row_does_what_the_table_says(row: Row) -> None:
    assert_verdict(row, outcome(row))
