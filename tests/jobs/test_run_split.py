"""How validate reads an input file (`jobs.run.split`): lines with their byte ranges, and chunks of accepted lines."""

from __future__ import annotations

import tracemalloc

from jobs.files import derived_file_id
from jobs.run.split import RejectedLine, ValidationTally, accepted_lines, iter_lines, split_into_chunks


def test_lines_carry_exact_byte_ranges_across_block_boundaries() -> None:
    data = b'{"a": 1}\n\n{"b": 22}\r\nlast line without newline'
    for block_size in (1, 3, 7, len(data)):
        blocks = [data[i : i + block_size] for i in range(0, len(data), block_size)]
        lines = list(iter_lines(blocks))
        assert [number for number, *_ in lines] == [1, 2, 3, 4]
        for _, start, end, line in lines:
            assert data[start:end].rstrip(b"\n") == line
        assert lines[-1][2] == len(data)


def test_a_byte_range_reads_back_with_its_original_line_numbers() -> None:
    data = b"one\ntwo\nthree\nfour\n"
    lines = list(iter_lines([data]))
    _, start, _, _ = lines[2]
    assert list(iter_lines([data[start:]], first_line=3, offset=start)) == lines[2:]


def test_derived_file_ids_are_stable_and_distinct() -> None:
    assert derived_file_id("batch_1", "output") == derived_file_id("batch_1", "output")
    assert derived_file_id("batch_1", "output") != derived_file_id("batch_1", "error")
    assert derived_file_id("batch_1", "output").startswith("file-")


class EveryOtherLine:
    """Input lines whose check rejects the lines saying "bad"; `per_chunk` accepted lines per chunk."""

    def __init__(self, per_chunk: int) -> None:
        self.per_chunk = per_chunk

    def check(self, line_number: int, line: bytes) -> str | RejectedLine:
        if b"bad" not in line:
            return line.decode()  # the line is its own id
        return RejectedLine(f"line {line_number}: bad", f"{line_number}\n".encode(), not_json=line == b"bad")

    def expired_record(self, request_id: str) -> bytes:
        return b"expired\n"

    def unrun_record(self, request_id: str, code: str, message: str) -> bytes:
        return f"{code}\n".encode()

    def too_long(self, line_number: int, limit: int) -> RejectedLine:
        return RejectedLine(f"line {line_number}: over {limit}", f"{line_number} too long\n".encode(), not_json=False)


def test_chunks_hold_per_chunk_accepted_lines_and_the_rejected_ones_among_them() -> None:
    data = b"a\nbad\nb\n\nc\n{bad}\nd\ne\n"
    errors: list[bytes] = []
    tally = ValidationTally()
    chunks = split_into_chunks([data], EveryOtherLine(per_chunk=2), tally, errors.append)
    assert [(c.first_line, c.num_requests, c.rejected_lines) for c in chunks] == [(1, 2, [2]), (4, 2, [6]), (8, 1, [])]
    assert chunks[0].byte_start == 0 and chunks[-1].byte_end == len(data)
    assert all(left.byte_end == right.byte_start for left, right in zip(chunks, chunks[1:]))  # no byte lost or doubled
    assert (tally.lines, tally.valid, tally.invalid, tally.not_json) == (7, 5, 2, 1)
    assert tally.first_problem == "line 2: bad" and errors == [b"2\n", b"6\n"]


def test_a_chunk_reads_back_its_accepted_lines_only() -> None:
    data = b"a\nbad\nb\n\nc\n{bad}\nd\ne\n"
    chunks = split_into_chunks([data], EveryOtherLine(per_chunk=2), ValidationTally(), lambda _: None)
    second = chunks[1]
    own_bytes = data[second.byte_start : second.byte_end]
    assert list(accepted_lines(own_bytes, second.first_line, second.byte_start, second.rejected_lines)) == [
        (5, b"c"),
        (7, b"d"),
    ]


def test_a_file_of_rejected_or_blank_lines_makes_no_chunk() -> None:
    tally = ValidationTally()
    assert split_into_chunks([b"bad\n\n{bad}\n"], EveryOtherLine(per_chunk=2), tally, lambda _: None) == []
    assert (tally.lines, tally.invalid) == (2, 2)


def test_a_line_over_the_limit_is_reported_without_its_bytes_at_any_block_size() -> None:
    data = b"short\n" + b"x" * 50 + b"\nok\n" + b"y" * 11
    for block_size in (1, 4, 9, len(data)):
        blocks = [data[i : i + block_size] for i in range(0, len(data), block_size)]
        lines = list(iter_lines(blocks, max_line_bytes=10))
        assert [(number, line) for number, _, _, line in lines] == [(1, b"short"), (2, None), (3, b"ok"), (4, None)]
        assert [(start, end) for _, start, end, _ in lines] == [(0, 6), (6, 57), (57, 60), (60, 71)]


def test_reading_a_50_mb_line_holds_about_one_limit_and_one_block() -> None:
    block = 1024 * 1024
    limit = 2 * block

    def blocks():  # 50 MB without a newline, then a short line: generated, never whole in memory
        for _ in range(50):
            yield b"z" * block
        yield b'\n{"after": 1}\n'

    tracemalloc.start()
    try:
        lines = [(number, line) for number, _, _, line in iter_lines(blocks(), max_line_bytes=limit)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lines == [(1, None), (2, b'{"after": 1}')]
    assert peak < limit + 3 * block, f"peak {peak / 1e6:.1f} MB"


def test_a_line_over_the_limit_is_refused_and_left_out_of_every_chunk() -> None:
    data = b"a\nb\n" + b"c" * 100 + b"\nd\nbad\ne\n"
    errors: list[bytes] = []
    tally = ValidationTally()
    chunks = split_into_chunks([data], EveryOtherLine(per_chunk=5), tally, errors.append, max_line_bytes=20)
    assert [(c.first_line, c.num_requests, c.rejected_lines) for c in chunks] == [(1, 2, []), (4, 2, [5])]
    assert all(b"c" * 21 not in data[c.byte_start : c.byte_end] for c in chunks)
    assert (tally.lines, tally.valid, tally.invalid) == (6, 4, 2)
    assert errors == [b"3 too long\n", b"5\n"] and tally.first_problem == "line 3: over 20"
