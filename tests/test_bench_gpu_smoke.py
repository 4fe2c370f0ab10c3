"""`python -m bench.gpu_throughput --smoke` runs end to end on the CPU: tiny shapes built from config
folders, conveyor and both HF baselines, the bandwidth floor, and the summary. And the decode steps
it measures against the floor are the right ones, with the right contexts."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor_kernels.triton_utils import TRITON_AVAILABLE, interpreter_enabled

pytest.importorskip("transformers")


def test_smoke_run_prints_every_table(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import gpu_throughput
    from bench.throughput import make_workload

    gpu_throughput.main(["--smoke"])
    out = capsys.readouterr().out

    requested = sum(r.output_len for r in make_workload(8, (8, 48), (4, 24), 1024, seed=0))
    for model in gpu_throughput.SMOKE_SHAPES:
        assert f"### {model}: 8 requests, prompt 8-48, output 4-24 tokens" in out
        assert f"{model}: HF runs capped at the first 6 of 8 requests" in out
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    # engine, requests, seconds, output tokens: every requested token counted, none more.
    assert [row[1] for row in rows if row[0] == "conveyor"] == ["8", "8"]
    assert [row[3] for row in rows if row[0] == "conveyor"] == [str(requested)] * 2
    assert [row[1] for row in rows if row[0].startswith("hf ")] == ["6"] * 4
    # HF's attention is pinned: generate_batch may not switch to whatever flash kernel is installed.
    assert out.count("HF attention implementation that ran: hf static generate: sdpa; hf generate_batch: sdpa") == 2
    assert out.count("| decode-only steps |") == 2
    if TRITON_AVAILABLE and interpreter_enabled():
        assert "### decode attention kernel: 4 q heads, 2 kv heads, head_dim 16" in out
    else:
        assert "decode attention kernel: skipped" in out
    summary = out[out.index("### summary") :]
    assert "tiny-llama: conveyor / hf generate_batch >= 3x" in summary
    assert "llama-3-8b: decode step at batch >= 128 within 1.5x of the floor" in summary


def test_decode_steps_are_recorded_with_their_contexts(tiny_dummy_model: Path) -> None:
    from bench.gpu_throughput import DecodeStepRecorder
    from bench.throughput import BenchRequest, run_conveyor
    from engine import LLM

    llm = LLM(model=str(tiny_dummy_model), load_format="dummy", dtype="float32", device="cpu")
    recorder = DecodeStepRecorder(llm.engine, bandwidth=1.0)  # floor seconds = bytes to read
    run_conveyor(llm, [BenchRequest([5] * 10, 5), BenchRequest([6] * 10, 8)], recorder.after_step)

    # One step prefills both prompts and samples their first tokens; decodes follow, one token each.
    assert [s.batch for s in recorder.steps] == [2] * 4 + [1] * 3
    contexts = [2 * 11, 2 * 12, 2 * 13, 2 * 14, 15, 16, 17]
    expected = [recorder.weight_bytes + c * recorder.kv_bytes_per_token for c in contexts]
    assert [s.floor_seconds for s in recorder.steps] == expected


def test_kernels_alone(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import json

    from bench import gpu_throughput

    gpu_throughput.main(["--smoke", "--kernels", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "### tiny-" not in out and "conveyor / hf" not in out
    assert "llama-3-8b: decode step at batch >= 128 within 1.5x of the floor" in out  # reported as not run
    # The files hold what was printed: the summary in both, the kernel's figures (or why it was skipped).
    results = json.loads((tmp_path / "results.json").read_text())
    assert "models" not in results and "decode_attention_kernel" in results
    assert "### summary" in (tmp_path / "results.md").read_text() and "### summary" in results["summary"]


def test_models_and_kernels_share_a_process() -> None:
    import argparse

    from bench import gpu_throughput

    parser = argparse.ArgumentParser()
    gpu_throughput.add_arguments(parser)
    assert gpu_throughput.parts(parser.parse_args([])) == (list(gpu_throughput.MODELS), True)
    assert gpu_throughput.parts(parser.parse_args(["--models", "llama-3-8b"])) == (["llama-3-8b"], False)
    assert gpu_throughput.parts(parser.parse_args(["--kernels"])) == ([], True)
    assert gpu_throughput.parts(parser.parse_args(["--models", "llama-3-8b", "--kernels"])) == (["llama-3-8b"], True)


def test_continuous_batching_options_a_transformers_lacks_are_left_out_and_named() -> None:
    """transformers 5.17's ContinuousBatchingConfig has no auto_switch_to_flash (5.24's has): passing it anyway
    killed the run after conveyor and HF static had finished."""
    from dataclasses import dataclass

    from bench.gpu_throughput import dataclasses_fields, supported_options

    @dataclass
    class ConfigOf517:  # the fields that matter here, as 5.17 has them
        num_blocks: int | None = None
        max_batch_tokens: int | None = None

    options = {"auto_switch_to_flash": False, "num_blocks": 9, "max_batch_tokens": 256}
    kept, left_out = supported_options(options, dataclasses_fields(ConfigOf517))
    assert ConfigOf517(**kept) == ConfigOf517(9, 256) and left_out == ["auto_switch_to_flash"]


@pytest.mark.parametrize("command", [["--models", "qwen3-0.6b"], ["--models", "llama-3-8b"], ["--kernels"]])
def test_each_documented_command_is_estimated_well_within_the_gpu_command_limit(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from bench import gpu_throughput

    parser = argparse.ArgumentParser()
    gpu_throughput.add_arguments(parser)
    args = parser.parse_args(command)
    for key, value in gpu_throughput.FULL_DEFAULTS.items():
        setattr(args, key, getattr(args, key) or value)
    gpu_throughput.print_estimate(args)
    out = capsys.readouterr().out
    minutes = float(out.split("H100 estimate: ")[1].split(" min")[0])
    assert minutes * 60 <= gpu_throughput.COMMAND_LIMIT_SECONDS / 2 and "; within the 10-minute" in out
