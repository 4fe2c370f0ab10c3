"""Splitting an input file into chunks: validate's one pass over the input's lines.

A chunk is a byte range of the input holding up to `InputLines.per_chunk` accepted lines, plus the numbers of the
lines validation rejected inside it (their error records are already written, so running the chunk skips them).
Blank lines carry nothing and belong to whichever chunk they fall in. What a line must be is the job kind's
business (`InputLines`); splitting only counts.

Lines are read in bounded pieces: a line longer than `max_line_bytes` (Settings.max_line_bytes) is refused without
being held, parsed or tokenised whole (`InputLines.too_long` writes its error), and no chunk's byte range covers
it, so running a chunk never reads it either. Memory stays at about one line limit plus one read block.

A chunk also keeps the ids of its accepted lines (`custom_id`, a document's `id`): what its requests' error records
need when the chunk cannot run or expires unrun, so that those records never depend on reading the input again
(it may be what failed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

LineNumber = int  # 1-based, as a text editor counts
RequestId = str  # an accepted line's id: an OpenAI line's custom_id, a RAG document's id


@dataclass(frozen=True)
class RejectedLine:
    """An input line validate refused."""

    message: str  # "line N: why"
    record: bytes  # its JSONL error record for the error file, newline included
    not_json: bool  # not a JSON object at all: a file of nothing else is not JSONL and fails the batch


class InputLines(Protocol):
    """One kind of job's input lines (batch requests, RAG documents), as validate and finalize handle them."""

    @property
    def per_chunk(self) -> int: ...  # accepted lines per chunk

    def check(self, line_number: LineNumber, line: bytes) -> RequestId | RejectedLine: ...  # accepted: its id

    def refusal(self, tally: ValidationTally) -> tuple[str, str] | None:
        """(code, message) failing the whole batch once every line was checked (over a limit); None: it runs."""
        ...

    def expired_record(self, request_id: RequestId) -> bytes: ...  # the error record of an accepted line that never ran

    def unrun_record(self, request_id: RequestId, code: str, message: str) -> bytes: ...  # an accepted line that cannot run

    def too_long(self, line_number: LineNumber, limit: int) -> RejectedLine: ...  # a line over `limit` bytes, never read whole


@dataclass
class ChunkDraft:
    """A chunk as validate sees it before its row exists."""

    byte_start: int
    first_line: LineNumber
    byte_end: int = 0  # exclusive
    num_requests: int = 0  # accepted lines
    rejected_lines: list[LineNumber] = field(default_factory=list)
    request_ids: list[RequestId] = field(default_factory=list)  # of the accepted lines, in order


@dataclass
class ValidationTally:
    lines: int = 0  # non-blank lines
    valid: int = 0
    invalid: int = 0
    not_json: int = 0
    first_problem: str | None = None


def iter_lines(
    blocks: Iterable[bytes], first_line: LineNumber = 1, offset: int = 0, max_line_bytes: int | None = None
) -> Iterator[tuple[LineNumber, int, int, bytes | None]]:
    """(line number, start byte, end byte exclusive, line without its newline) for each line of a byte stream; the
    line is None when it is longer than `max_line_bytes`: its bytes are counted and dropped, never gathered."""
    pending = bytearray()  # the current line's bytes so far, while it is within the limit
    line_start, line_bytes, line_number = offset, 0, first_line

    def too_long() -> bool:
        return max_line_bytes is not None and line_bytes > max_line_bytes

    for block in blocks:
        position = 0
        while (newline := block.find(b"\n", position)) >= 0:
            line_bytes += newline - position
            if not too_long():
                pending += block[position:newline]
            end = line_start + line_bytes + 1
            yield line_number, line_start, end, None if too_long() else bytes(pending)
            pending = bytearray()
            line_start, line_bytes, line_number = end, 0, line_number + 1
            position = newline + 1
        line_bytes += len(block) - position
        if too_long():
            pending = bytearray()  # a new object: clear() could keep the old capacity
        else:
            pending += block[position:]
    if line_bytes:
        yield line_number, line_start, line_start + line_bytes, None if too_long() else bytes(pending)


def split_into_chunks(
    blocks: Iterable[bytes],
    lines: InputLines,
    tally: ValidationTally,
    write_error: Callable[[bytes], None],
    max_line_bytes: int | None = None,
) -> list[ChunkDraft]:
    """Check every line of the input, write each rejected line's error record, and cut the accepted ones into
    chunks of `lines.per_chunk`; `tally` counts them all."""
    chunks: list[ChunkDraft] = []
    draft: ChunkDraft | None = None
    for line_number, start, end, line in iter_lines(blocks, max_line_bytes=max_line_bytes):
        if line is None:  # too long: refused, and kept out of every chunk's byte range
            assert max_line_bytes is not None
            if draft is not None and draft.num_requests > 0:
                chunks.append(draft)
            draft = None
            tally.lines += 1
            tally.invalid += 1
            rejected = lines.too_long(line_number, max_line_bytes)
            tally.first_problem = tally.first_problem or rejected.message
            write_error(rejected.record)
            continue
        if draft is None:
            draft = ChunkDraft(byte_start=start, first_line=line_number)
        draft.byte_end = end
        if not line.strip():  # blank lines carry no request
            continue
        tally.lines += 1
        checked = lines.check(line_number, line)
        if isinstance(checked, RejectedLine):
            rejected = checked
            tally.invalid += 1
            tally.not_json += rejected.not_json
            tally.first_problem = tally.first_problem or rejected.message
            write_error(rejected.record)
            draft.rejected_lines.append(line_number)
            continue
        tally.valid += 1
        draft.num_requests += 1
        draft.request_ids.append(checked)
        if draft.num_requests == lines.per_chunk:
            chunks.append(draft)
            draft = None
    if draft is not None and draft.num_requests > 0:
        chunks.append(draft)
    return chunks


def accepted_lines(
    data: bytes, first_line: LineNumber, byte_start: int, rejected_lines: Iterable[LineNumber]
) -> Iterator[tuple[LineNumber, bytes]]:
    """A chunk's lines that validate accepted, with their numbers, from the chunk's bytes."""
    rejected = set(rejected_lines)  # validation already wrote their error records
    for line_number, _, _, line in iter_lines([data], first_line, byte_start):
        if line is not None and line_number not in rejected and line.strip():
            yield line_number, line
