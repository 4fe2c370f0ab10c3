"""A job's first failed lines, grouped by error code, each with the input line it came from: what a person reads
to see why lines failed, without downloading the error file.

Error records are OpenAI's (`custom_id`, `error.code`, `error.message`) and carry no line number. A line refused by
validation names its line in its message ("line 12: ..."); for the others the line is found by reading the input
file from its start until every wanted `custom_id` is met, within `INPUT_SCAN_BYTES` (error records come in chunk
order, so the first ones are near the input's start).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from jobs.db import SessionFactory
from jobs.errors import ServiceError
from jobs.files import get_file
from jobs.storage import ObjectStore

FIRST_ERRORS = 100  # error records read
ERROR_HEAD_BYTES = 1 << 20  # of the error file read for them
INPUT_SCAN_BYTES = 64 << 20  # of the input file read at most to find their lines
_LINE_IN_MESSAGE = re.compile(r"^line (\d+): ")


@dataclass(frozen=True)
class FailedLine:
    line: int | None  # 1-based line of the input; None: not found within INPUT_SCAN_BYTES, or the input is gone
    custom_id: str | None
    message: str


@dataclass
class ErrorGroup:
    code: str
    lines: list[FailedLine] = field(default_factory=list)


@dataclass(frozen=True)
class FirstErrors:
    groups: list[ErrorGroup]  # by number of lines, most first
    records_read: int  # error records behind `groups`
    complete: bool  # whether those are all of the error file's records


def first_errors(
    sessions: SessionFactory, store: ObjectStore, project_id: str, error_file_id: str, input_file_id: str
) -> FirstErrors:
    """The first FIRST_ERRORS records of the project's error file, grouped; an error file that expired or was deleted
    raises not_found as its download would."""
    with sessions() as session:
        error_file = get_file(session, project_id, error_file_id)
        try:
            input_file = get_file(session, project_id, input_file_id)
        except ServiceError:  # deleted since: the lines stay unknown
            input_file = None
    head_bytes = min(error_file.bytes, ERROR_HEAD_BYTES)
    head = store.read_range(error_file.object_key, 0, head_bytes) if head_bytes else b""
    whole_lines = head if head_bytes == error_file.bytes else head[: head.rfind(b"\n") + 1]
    records = [json.loads(line) for line in whole_lines.splitlines() if line.strip()]
    complete = head_bytes == error_file.bytes and len(records) <= FIRST_ERRORS
    records = records[:FIRST_ERRORS]
    wanted = {record["custom_id"] for record in records if record.get("custom_id") is not None and _stated_line(record) is None}
    lines = _lines_of(store, input_file.object_key, wanted) if input_file is not None and wanted else {}
    groups: dict[str, ErrorGroup] = {}
    for record in records:
        error, custom_id = record["error"], record.get("custom_id")
        line = _stated_line(record) or lines.get(custom_id)
        groups.setdefault(error["code"], ErrorGroup(error["code"])).lines.append(
            FailedLine(line, custom_id, error["message"])
        )
    ordered = sorted(groups.values(), key=lambda group: -len(group.lines))
    return FirstErrors(ordered, len(records), complete)


def _stated_line(record: dict[str, Any]) -> int | None:
    match = _LINE_IN_MESSAGE.match(record["error"]["message"])
    return int(match.group(1)) if match else None


def _lines_of(store: ObjectStore, input_key: str, custom_ids: set[str]) -> dict[str, int]:
    """custom_id -> its 1-based line in the input, for those met within INPUT_SCAN_BYTES."""
    found: dict[str, int] = {}
    line_number, read, pending = 0, 0, b""
    for block in store.open_stream(input_key):
        read += len(block)
        *complete_lines, pending = (pending + block).split(b"\n")
        for line in complete_lines:
            line_number += 1
            _note(line, line_number, custom_ids, found)
        if len(found) == len(custom_ids) or read >= INPUT_SCAN_BYTES:
            return found
    _note(pending, line_number + 1, custom_ids, found)
    return found


def _note(line: bytes, line_number: int, custom_ids: set[str], found: dict[str, int]) -> None:
    try:
        custom_id = json.loads(line).get("custom_id")
    except (ValueError, AttributeError):  # not a JSON object: validation reported it with its line already
        return
    if isinstance(custom_id, str) and custom_id in custom_ids and custom_id not in found:
        found[custom_id] = line_number
