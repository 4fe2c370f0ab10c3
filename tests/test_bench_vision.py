"""The images benchmark at the tests' tiny shapes, Qwen2.5-VL-like, LLaVA and Gemma 3: `python -m bench.vision`
prints both tables, conveyor's tokens equal HF's batched `generate`, and the chunked run reuses encoder outputs only
with the encoder cache on (Gemma 3 computes an image in one step: its chunks never split one, each is encoded once)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("family", "splits_images"), [("qwen2_5_vl", True), ("llava", True), ("gemma3", False)])
def test_vision_bench_prints_the_tables(capsys: pytest.CaptureFixture[str], family: str, splits_images: bool) -> None:
    from bench import vision

    chunks = ["--chunk-tokens", "5"] if splits_images else []  # Gemma 3's default: one image's 16 placeholders
    vision.main([
        "--family", family, "--shape", "tiny", "--lines", "4", "--max-tokens", "4", "--repeats", "1", *chunks,
        "--hf-batch-size", "2",
    ])
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    rows = [row for row in rows if not row[0].startswith(":-")]  # the tables' rules
    assert [row[0] for row in rows] == [
        "run", "conveyor", "HF generate, batches of 2", "run", "encoder cache on", "encoder cache off"
    ]
    assert "identical to HF: 4/4 lines" in out
    on, off = rows[4], rows[5]
    assert on[1] == off[1] == on[2] == "2"  # two image lines, each encoded once with the cache
    if splits_images:  # without the cache, every chunk reaching an image encodes it
        assert int(on[3]) > 0 and off[3] == "0" and int(off[2]) > 2
    else:
        assert off[2] == "2" and on[3] == off[3] == "0"
    assert on[-1] == off[-1] == "4/4"
