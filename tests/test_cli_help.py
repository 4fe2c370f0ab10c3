"""`conveyor --help` and the subcommands' `--help` answer at once: building the parser imports no torch or engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Run in a fresh interpreter: this test process has long imported torch. Prints the heavy modules `--help` loaded.
_PROBE = """
import sys
from conveyor.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = ("torch", "transformers", "engine.llm_engine", "bench.report", "celery", "sqlalchemy", "fastapi")
print(",".join(name for name in heavy if name in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "command",
    [[], ["run"], ["up"], ["bench"], ["bench", "report"], ["api"], ["worker"], ["beat"], ["db"], ["db", "upgrade"], ["keys"]],
)
def test_help_imports_no_heavy_module(command: list[str]) -> None:
    finished = subprocess.run(
        [sys.executable, "-c", _PROBE, *command, "--help"], capture_output=True, text=True, timeout=120, check=True
    )
    assert "usage: conveyor" in finished.stdout
    assert finished.stderr.strip() == "", f"--help imported {finished.stderr}"


def test_bench_options_name_the_report_sizes_and_clocks_that_exist() -> None:
    """bench.options keeps the choices torch-free; the modules that run them hold what they mean."""
    from bench import report, scheduling_runs
    from bench.options import CLOCKS, REPORT_SIZES

    assert set(REPORT_SIZES) == set(report.SIZES)
    assert set(CLOCKS) == set(scheduling_runs.CLOCKS)
