"""Every row of docs/openai_compatibility.md, checked: what the table says conveyor does with a field is what it does."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from pydantic import ValidationError

from api.schemas import CreateBatch
from jobs import files
from jobs.errors import ServiceError
from jobs.models import utcnow
from jobs.openai_format.validation import LineError
from tests.jobs.test_openai_format import validator

TABLE = Path(__file__).parents[1] / "docs" / "openai_compatibility.md"
URLS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}
BASE_BODIES: dict[str, dict[str, Any]] = {
    "chat": {"messages": [{"role": "user", "content": "hi"}]},
    "completions": {"prompt": "one two"},
    "embeddings": {"input": "hi"},
    "responses": {"input": "hi"},
}
BASE_BATCH = {"input_file_id": "file-x", "endpoint": "/v1/responses", "completion_window": "24h"}


class Row(NamedTuple):
    endpoint: str
    field: str
    example: Any
    verdict: str  # honoured, no-op or refused
    note: str


def rows() -> list[Row]:
    found = []
    for line in TABLE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("Endpoint", "---"):
            continue
        example = json.loads(cells[2].strip("`"))
        found.append(Row(cells[0], cells[1], example, cells[3], cells[4]))
    return found


def quoted(note: str) -> str | None:
    match = re.search(r'"([^"]+)"', note)
    return match.group(1) if match else None


def body_for(row: Row) -> dict[str, Any]:
    """The endpoint's smallest body plus the row's field: a dict example holding several fields (e.g. echo with
    logprobs) is merged; otherwise the example is the field's value."""
    name = row.field.split("`")[1].split("[")[0]
    body = dict(BASE_BODIES[row.endpoint])
    if isinstance(row.example, dict) and " with " in row.field:
        body.update(row.example)
    else:
        body[name] = row.example
    return body


def outcome(row: Row) -> str | None:
    """None when accepted, else the refusal's message."""
    if row.endpoint in URLS:
        line = json.dumps({"custom_id": "row", "method": "POST", "url": URLS[row.endpoint], "body": body_for(row)})
        checked = validator().validate(line)
        return checked.message if isinstance(checked, LineError) else None
    if row.endpoint == "batch create":
        try:
            CreateBatch.model_validate({**BASE_BATCH, **row.example})
        except ValidationError as invalid:
            return str(invalid)
        return None
    assert row.endpoint == "file upload", row
    try:
        files.parse_upload_purpose(row.example.get("purpose"))
        files.upload_expiry(row.example, utcnow())
    except ServiceError as refused:
        return refused.message
    return None


def test_the_table_covers_every_endpoint_and_verdict() -> None:
    table = rows()
    assert {row.endpoint for row in table} == {*URLS, "batch create", "file upload"}
    assert {row.verdict for row in table} == {"honoured", "no-op", "refused"}


@pytest.mark.parametrize("row", rows(), ids=lambda row: f"{row.endpoint}:{row.field}:{row.verdict}")
def test_each_row_does_what_the_table_says(row: Row) -> None:
    assert_verdict(row, outcome(row))


def assert_verdict(row: Row, refusal: str | None) -> None:
    """A refused row was refused, with its quoted words; the others were accepted."""
    if row.verdict == "refused":
        assert refusal is not None, f"{row} was accepted"
        expected = quoted(row.note)
        assert expected is None or expected in refusal, refusal
    else:
        assert refusal is None, refusal
