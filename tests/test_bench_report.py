"""`conveyor bench report` runs end to end at its tiny size (on a small random model, so it takes
seconds) and writes the report, its plots and its raw numbers."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from conveyor.cli import main
from tests.conftest import save_random_hf_model

pytest.importorskip("matplotlib")


def test_the_report_runs_end_to_end_and_writes_its_files(tmp_path: Path) -> None:
    model = save_random_hf_model("llama", tmp_path / "model")
    out = tmp_path / "report"
    arguments = [
        "bench", "report", "--out", str(out), "--size", "tiny", "--model", str(model), "--dtype", "float32", "--clock", "cpu",
    ]
    assert main(arguments) == 0

    for name in ("report.md", "runs.csv", "steps.csv", "throughput_vs_spread.png", "latency_vs_rate.png",
                 "chunk_size.png", "over_time.png"):
        assert (out / name).stat().st_size > 0, name
    with open(out / "runs.csv") as handle:
        runs = list(csv.DictReader(handle))
    labels = {(row["experiment"], row["label"]) for row in runs}
    assert {("spread", "static"), ("spread", "continuous"), ("spread", "hf static")} <= labels
    assert {("arrival", "static"), ("arrival", "continuous"), ("chunk", "continuous")} <= labels
    assert {("prefix", "arrival order"), ("prefix", "prefix-aware"), ("lookahead", "lookahead")} <= labels
    # every policy produced every requested token of the same workload
    spread_tokens = {row["x"]: row["output_tokens"] for row in runs if row["experiment"] == "spread"}
    assert all(row["output_tokens"] == spread_tokens[row["x"]] for row in runs if row["experiment"] == "spread")
    prefill = {row["label"]: int(row["prefill_tokens"]) for row in runs if row["experiment"] == "prefix"}
    assert prefill["prefix-aware"] < prefill["arrival order"]
    report = (out / "report.md").read_text()
    assert "![throughput vs spread](throughput_vs_spread.png)" in report
    assert "fewer prefill tokens" in report
