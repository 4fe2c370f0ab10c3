"""What `conveyor up` repeats from its children's log files on its own console: their errors (a worker that cannot
serve its metrics, a failed migration, a task's crash), each once, with the log's path, so a feature that stopped
working is seen where the person is looking rather than only in `logs/*.log`; and, while a slow start is awaited,
the log's latest line as a sign of life."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

# The two formats of jobs.telemetry.logs: text "<date> <time> LEVEL logger: message", and JSON with a "level" field.
_TEXT_ERROR = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) ")
_SHOWN_CHARS = 300  # an error line longer than this (a huge repr) is cut on the console; the log keeps it whole


def is_error_line(line: str) -> bool:
    record = _json_record(line)
    if record is not None:
        return record.get("level") in ("ERROR", "CRITICAL")
    return _TEXT_ERROR.match(line) is not None


def readable(line: str) -> str:
    """A JSON record as `LEVEL logger: message` (a console shows that better than the whole object); text as is."""
    record = _json_record(line)
    if record is None or "message" not in record:
        return _cut(line)
    return _cut(f"{record.get('level', '')} {record.get('logger', '')}: {record['message']}")


def _json_record(line: str) -> dict[str, object] | None:
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


@dataclass
class ChildLog:
    """One child's log file, read from where it stood when the child started: errors of earlier runs are not news."""

    name: str
    path: Path
    _offset: int = field(default=0)
    _partial: bytes = b""
    last_line: str = ""

    @classmethod
    def from_now(cls, name: str, path: Path) -> ChildLog:
        return cls(name, path, path.stat().st_size if path.exists() else 0)

    def new_errors(self) -> list[str]:
        """The error lines written since the last call, each as the console shows it."""
        try:
            with self.path.open("rb") as log:
                log.seek(self._offset)
                written = log.read()
        except OSError:
            return []
        self._offset += len(written)
        *complete, self._partial = (self._partial + written).split(b"\n")
        lines = [raw.decode(errors="replace").rstrip() for raw in complete]
        if any(lines):
            self.last_line = readable(next(line for line in reversed(lines) if line))
        return [f"{self.name}: {readable(line)} (see {self.path})" for line in lines if is_error_line(line)]


def _cut(line: str) -> str:
    return line if len(line) <= _SHOWN_CHARS else line[:_SHOWN_CHARS] + " …"
