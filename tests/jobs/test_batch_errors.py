"""A job's first failed lines, grouped by code with their input lines, read from real S3 and PostgreSQL."""

from __future__ import annotations

import json

import pytest

from jobs import db
from jobs.batch_errors import first_errors
from jobs.errors import ServiceError
from jobs.files import record_file
from jobs.keys import create_key_in_database
from jobs.models import FilePurpose, new_id
from jobs.storage import ObjectStore


def error_line(custom_id: str | None, code: str, message: str) -> dict:
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


def stored_file(sessions: db.SessionFactory, store: ObjectStore, project_id: str, lines: list) -> str:
    data = b"".join(json.dumps(line).encode() + b"\n" if not isinstance(line, bytes) else line + b"\n" for line in lines)
    file_id = new_id("file-")
    store.put_bytes(f"test-errors/{file_id}", data)
    with sessions.begin() as session:
        record_file(session, file_id=file_id, project_id=project_id, filename="f.jsonl", purpose=FilePurpose.batch,
                    size=len(data), object_key=f"test-errors/{file_id}")
    return file_id


def test_errors_are_grouped_by_code_with_their_input_lines(database_url: str, object_store: ObjectStore) -> None:
    project_id = create_key_in_database(database_url, "errors-project").project_id
    sessions = db.make_session_factory(db.make_engine(database_url))
    input_id = stored_file(sessions, object_store, project_id, [
        {"custom_id": "a", "body": {}}, b"not json", {"custom_id": "b", "body": {}}, {"custom_id": "c", "body": {}},
        {"custom_id": "d", "body": {}},
    ])
    error_id = stored_file(sessions, object_store, project_id, [
        error_line(None, "invalid_json_line", "line 2: the line is not JSON"),
        error_line("c", "generation_failed", "the engine failed"),
        error_line("d", "generation_failed", "the engine failed"),
        error_line("gone", "generation_failed", "the engine failed"),
    ])
    errors = first_errors(sessions, object_store, project_id, error_id, input_id)
    assert errors.complete and errors.records_read == 4
    assert [(group.code, [line.line for line in group.lines]) for group in errors.groups] == [
        ("generation_failed", [4, 5, None]),
        ("invalid_json_line", [2]),
    ]
    assert errors.groups[0].lines[0].custom_id == "c"

    other_project = create_key_in_database(database_url, "errors-other").project_id
    with pytest.raises(ServiceError, match="No such File object"):
        first_errors(sessions, object_store, other_project, error_id, input_id)
