"""How validate reads an input file: lines with their byte ranges, and chunks of valid requests."""

from __future__ import annotations

from jobs.pipeline import derived_file_id, iter_lines


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
