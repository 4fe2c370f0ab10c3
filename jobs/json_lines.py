"""Reading one JSONL line as JSON, for every kind of input line: what json.loads lets through that must not pass.

JSON nested thousands of levels deep makes json.loads raise RecursionError, which no caller expects of a parse; a
lone UTF-16 surrogate escape ("\\ud800") parses into a str that no UTF-8 output, object key or log line can hold.
Both are the line's problem, reported as `UnreadableLine`.
"""

from __future__ import annotations

import json
from typing import Any


class UnreadableLine(ValueError):
    """The line parses as JSON only in a way nothing downstream could hold."""


def load_json_line(line: str | bytes) -> Any:
    """json.loads, plus UnreadableLine for deep nesting and lone surrogates; ValueError (json's, or
    UnicodeDecodeError) for a line that is not JSON."""
    try:
        value = json.loads(line)
    except RecursionError:
        raise UnreadableLine("the line's JSON is nested too deeply to read") from None
    # Only an escape can spell a lone surrogate, and only lines with one pay for the check.
    if (b"\\u" if isinstance(line, bytes) else "\\u") in line:
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as lone:
            raise UnreadableLine(f"the line holds a lone UTF-16 surrogate escape, not Unicode text ({lone.reason})") from None
        except RecursionError:
            raise UnreadableLine("the line's JSON is nested too deeply to write back") from None
    return value
