"""`bench.throughput --model <dummy shape> --small` runs every family's shape on the CPU."""

from __future__ import annotations

import pytest

from bench import throughput
from engine.model_registry import DUMMY_SHAPES


@pytest.mark.parametrize("shape", sorted(DUMMY_SHAPES))
def test_throughput_runs_each_shape_small(shape, capsys):
    throughput.main([
        "--model", shape, "--small", "--skip-hf", "--dtype", "float32", "--num-requests", "3",
        "--prompt-len", "70", "90", "--output-len", "4", "6",
    ])
    assert "conveyor:" in capsys.readouterr().out
